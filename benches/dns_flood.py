#!/usr/bin/env python3
"""A flood to a route whose backend name never answers, beside a route whose name does.

Runs a trellis binary as a gateway inside a network namespace of its own, whose
/etc/resolv.conf (`ip netns exec` mounts /etc/netns/NAME/resolv.conf) names a DNS server
this script runs on 127.0.0.1:53 there: `healthy.test` answers 127.0.0.1 with a 1 s TTL,
`dark.test` is never answered. Two waves of 300 connections go to the dark route while 25
requests, 80 ms apart, go to the healthy one (an echo backend). Prints the gateway's most
threads, the healthy requests served and the queries the DNS server saw.
Needs root (a network namespace). Usage: benches/dns_flood.py TRELLIS_BINARY
"""
import ctypes, os, socket, ssl, struct, subprocess, sys, tempfile, threading, time

NS = f"trellis-dnsflood-{os.getpid()}"
LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
WAVE = 300


def client_hello(sni):
    ctx = ssl.create_default_context()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()


def in_ns(fn):
    """Runs fn in a thread that has entered the namespace (setns)."""
    fd = os.open(f"/var/run/netns/{NS}", os.O_RDONLY)
    def run():
        if LIBC.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        os.close(fd)
        fn()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


queries = {}


def dns_server(ready):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 53))
    ready.set()
    while True:
        data, peer = s.recvfrom(4096)
        qid, flags = struct.unpack("!HH", data[:4])
        i, labels = 12, []
        while data[i]:
            labels.append(data[i + 1 : i + 1 + data[i]].decode().lower())
            i += 1 + data[i]
        qtype = struct.unpack("!H", data[i + 1 : i + 3])[0]
        question = data[12 : i + 5]
        name = ".".join(labels)
        queries[(name, qtype)] = queries.get((name, qtype), 0) + 1
        if name == "dark.test":
            continue
        if name == "healthy.test":
            answers = b""
            if qtype == 1:
                answers = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 1, 4) + bytes([127, 0, 0, 1])
            head = struct.pack("!HHHHHH", qid, 0x8180 | (flags & 0x0100), 1, 1 if answers else 0, 0, 0)
        else:
            head = struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0)
            answers = b""
        s.sendto(head + question + answers, peer)


def echo_server(port, ready):
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("127.0.0.1", port))
    l.listen(512)
    ready.set()
    while True:
        c, _ = l.accept()
        def echo(c=c):
            with c:
                while (b := c.recv(65536)):
                    c.sendall(b)
        threading.Thread(target=echo, daemon=True).start()


def hello(port, sni, limit):
    got = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
            s.sendall(client_hello(sni))
            s.shutdown(socket.SHUT_WR)
            while (b := s.recv(65536)):
                got += b
    except OSError:
        pass
    return got


def threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(l for l in f if l.startswith("Threads:")).split()[1])


def main():
    binary = os.path.abspath(sys.argv[1])
    subprocess.run(["ip", "netns", "add", NS], check=True)
    os.makedirs(f"/etc/netns/{NS}", exist_ok=True)
    with open(f"/etc/netns/{NS}/resolv.conf", "w") as f:
        f.write("nameserver 127.0.0.1\n")
    gw = None
    try:
        subprocess.run(["ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up"], check=True)
        ready = threading.Event()
        in_ns(lambda: dns_server(ready)); ready.wait()
        ready = threading.Event()
        in_ns(lambda: echo_server(9000, ready)); ready.wait()
        d = tempfile.mkdtemp()
        with open(f"{d}/routes.yaml", "w") as f:
            f.write("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n"
                    "- {name: healthy, sni: [healthy.example.com], backends: [{address: \"healthy.test:9000\"}]}\n"
                    "- {name: dark, sni: [dark.example.com], backends: [{address: \"dark.test:9000\"}]}\n")
        with open(f"{d}/gateway.yaml", "w") as f:
            f.write("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\n"
                    "routes: {file: routes.yaml}\n"
                    "listeners: [{name: tls, address: \"127.0.0.1:9443\", protocol: sni}]\n"
                    "admin: {address: \"127.0.0.1:15021\"}\n")
        gw = subprocess.Popen(["ip", "netns", "exec", NS, binary, "gateway", "--config", f"{d}/gateway.yaml"],
                              stderr=subprocess.DEVNULL, env={**os.environ, "TRELLIS_LOG": "error"})
        time.sleep(1.5)
        pid = gw.pid  # `ip netns exec` execs the binary in place
        most = [threads(pid)]
        done = threading.Event()
        def sample():
            while not done.is_set():
                most[0] = max(most[0], threads(pid))
                time.sleep(0.02)
        threading.Thread(target=sample, daemon=True).start()
        def flood():
            for _ in range(2):
                wave = [in_ns(lambda: hello(9443, "dark.example.com", 15)) for _ in range(WAVE)]
                for t in wave:
                    t.join()
        flooder = in_ns(flood)
        want = len(client_hello("healthy.example.com"))
        served = [0]
        def healthy():
            for _ in range(25):
                t0 = time.time()
                if len(hello(9443, "healthy.example.com", 10)) >= want:
                    served[0] += 1
                time.sleep(max(0, 0.08 - (time.time() - t0)))
        in_ns(healthy).join()
        flooder.join()
        done.set()
        print(f"binary {binary}: most threads {most[0]}, healthy served {served[0]}/25, "
              f"queries healthy.test {queries.get(('healthy.test', 1), 0)} A + {queries.get(('healthy.test', 28), 0)} AAAA, "
              f"dark.test {queries.get(('dark.test', 1), 0)} A + {queries.get(('dark.test', 28), 0)} AAAA")
    finally:
        if gw is not None:
            gw.terminate()
            gw.wait()
        subprocess.run(["ip", "netns", "del", NS])
        subprocess.run(["rm", "-rf", f"/etc/netns/{NS}"])


if __name__ == "__main__":
    main()
