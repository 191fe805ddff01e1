//! A DNS server for tests, on a loopback UDP port: answers A and AAAA queries from a table,
//! answers NXDOMAIN for names it does not know, swallows queries for names it is told to
//! (a server that never answers), and counts every query by name and type.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{RData, Record, RecordType};

/// What the server says about one name.
#[derive(Clone, Debug)]
pub(crate) enum Zone {
    /// These addresses (A for IPv4, AAAA for IPv6; the other type answered with none), with
    /// this TTL in seconds.
    Answer(Vec<IpAddr>, u32),
    /// No answer at all.
    Silent,
}

/// A running server; stopped on drop.
pub(crate) struct DnsServer {
    /// Where it listens.
    pub addr: SocketAddr,
    queries: Arc<Mutex<HashMap<(String, RecordType), usize>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DnsServer {
    /// Starts a server on `127.0.0.1` that knows `names` (lower case, no trailing dot).
    pub(crate) fn start(names: &[(&str, Zone)]) -> DnsServer {
        let zones: HashMap<String, Zone> = names
            .iter()
            .map(|(n, z)| (n.to_string(), z.clone()))
            .collect();
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        let queries = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (queries, stop) = (queries.clone(), stop.clone());
            std::thread::spawn(move || serve(socket, zones, queries, stop))
        };
        DnsServer {
            addr,
            queries,
            stop,
            thread: Some(thread),
        }
    }

    /// Queries received for `name` of type `kind` (`"A"` or `"AAAA"`).
    pub(crate) fn queries(&self, name: &str, kind: &str) -> usize {
        let kind = match kind {
            "A" => RecordType::A,
            "AAAA" => RecordType::AAAA,
            other => panic!("unknown type {other}"),
        };
        let queries = self.queries.lock().unwrap();
        queries.get(&(name.to_string(), kind)).copied().unwrap_or(0)
    }

    /// Queries received for `name`, of any type.
    pub(crate) fn queries_for(&self, name: &str) -> usize {
        let queries = self.queries.lock().unwrap();
        queries
            .iter()
            .filter(|((n, _), _)| n == name)
            .map(|(_, c)| c)
            .sum()
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    socket: UdpSocket,
    zones: HashMap<String, Zone>,
    queries: Arc<Mutex<HashMap<(String, RecordType), usize>>>,
    stop: Arc<AtomicBool>,
) {
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        let Ok((n, from)) = socket.recv_from(&mut buf) else {
            continue;
        };
        let Ok(request) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        let Some(query) = request.queries.first().cloned() else {
            continue;
        };
        let name = query.name().to_ascii().to_ascii_lowercase();
        let name = name.strip_suffix('.').unwrap_or(&name).to_string();
        let kind = query.query_type();
        *queries
            .lock()
            .unwrap()
            .entry((name.clone(), kind))
            .or_default() += 1;
        let mut response = Message::response(request.metadata.id, OpCode::Query);
        response.metadata.recursion_desired = request.metadata.recursion_desired;
        response.metadata.recursion_available = true;
        response.add_query(query.clone());
        match zones.get(&name) {
            Some(Zone::Silent) => continue,
            Some(Zone::Answer(addrs, ttl)) => {
                for ip in addrs {
                    let data = match (ip, kind) {
                        (IpAddr::V4(v4), RecordType::A) => RData::A(A(*v4)),
                        (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(*v6)),
                        _ => continue,
                    };
                    response.add_answer(Record::from_rdata(query.name().clone(), *ttl, data));
                }
            }
            None => response.metadata.response_code = ResponseCode::NXDomain,
        }
        if let Ok(bytes) = response.to_vec() {
            let _ = socket.send_to(&bytes, from);
        }
    }
}
