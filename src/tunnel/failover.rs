//! A dial's failover policy: which peer of the route's shoot the next attempt goes through,
//! how long it waits alone before the next one joins it, and when the dial gives up; and
//! [`DialError`], why a dial fails.
//!
//! A dial tries live peers whose `allowedIPs` hold the target, best first
//! ([`Shoot::best_peer_except`]), those with an endpoint before those without (one whose
//! stream endpoint just ended has none until it is heard from again). With another live peer
//! left to try, an attempt gets [`FAILOVER_AFTER`] to itself; unanswered by then, the peers
//! tried so far become suspect and the next one joins (the earlier attempts keep running, and
//! the first answer wins). A replica that died still looks live until its session expires,
//! and only an unanswered SYN tells. Sans-IO: every call takes `now`; the driver opens the
//! attempts and waits for the answers.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use thiserror::Error;

use super::shoot::Shoot;
use super::stack::StackError;

/// How long a dial waits for an answer through one peer before an attempt through another
/// live peer of the route joins it (the first is marked suspect, and still wins if it
/// answers first).
pub(crate) const FAILOVER_AFTER: Duration = Duration::from_secs(1);

/// Why a stream could not be opened through a tunnel.
#[derive(Debug, Error)]
pub(crate) enum DialError {
    /// The route has no tunnel.
    #[error("the route has no tunnel")]
    NoTunnel,
    /// No peer whose `allowedIPs` hold the target has a live session.
    #[error("no live tunnel peer for the target")]
    NoLivePeer,
    /// The target answered with a reset.
    #[error("connection refused in the shoot")]
    Refused,
    /// No answer in time.
    #[error("no answer in time")]
    Timeout,
    /// The stack could not open the stream.
    #[error("{0}")]
    Stack(#[from] StackError),
    /// The route or peer went away while dialing.
    #[error("route removed")]
    RouteRemoved,
}

impl DialError {
    /// Every `reason` label.
    pub(crate) const REASONS: [&'static str; 6] = [
        "no_tunnel",
        "no_live_peer",
        "refused",
        "timeout",
        "stack",
        "route_removed",
    ];

    /// The `reason` label.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            DialError::NoTunnel => "no_tunnel",
            DialError::NoLivePeer => "no_live_peer",
            DialError::Refused => "refused",
            DialError::Timeout => "timeout",
            DialError::Stack(_) => "stack",
            DialError::RouteRemoved => "route_removed",
        }
    }
}

/// What a dial does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Open an attempt through peer `peer` (an index into the shoot's peers) now, and wait
    /// for an answer to any attempt until `until`; unanswered, see [`Failover::unanswered`].
    Dial {
        /// The peer.
        peer: usize,
        /// The end of its head start ([`FAILOVER_AFTER`]) when another live peer is left
        /// to try, else the dial's deadline.
        until: Instant,
    },
    /// Every live peer has an attempt under way: wait for an answer until the deadline.
    Wait {
        /// The dial's deadline.
        until: Instant,
    },
    /// No live peer holds the target and no attempt is under way: the dial fails
    /// ([`DialError::NoLivePeer`]).
    NoLivePeer,
}

/// What an unanswered wait leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unanswered {
    /// The deadline has come: the dial fails ([`DialError::Timeout`]).
    Timeout,
    /// Before the deadline: the peers tried so far are suspect now (these, by index, were
    /// not before), and the next choice may add an attempt through another peer.
    Suspect(Vec<usize>),
}

/// One dial's failover state: its deadline and the peers tried so far.
#[derive(Debug)]
pub(crate) struct Failover {
    deadline: Instant,
    /// Peers with an attempt under way, in the order they were tried.
    tried: Vec<usize>,
}

impl Failover {
    /// A dial that gives up at `deadline`.
    pub(crate) fn new(deadline: Instant) -> Failover {
        Failover {
            deadline,
            tried: Vec::new(),
        }
    }

    /// The next step of a dial to `target` through `shoot` at `now`; a peer it names counts
    /// as tried from here on.
    pub(crate) fn choose(&mut self, shoot: &Shoot, target: IpAddr, now: Instant) -> Choice {
        match next_live(shoot, target, now, &self.tried) {
            // Every peer tried has an attempt under way.
            None if self.tried.is_empty() => Choice::NoLivePeer,
            None => Choice::Wait {
                until: self.deadline,
            },
            Some(peer) => {
                self.tried.push(peer);
                let others = next_live(shoot, target, now, &self.tried).is_some();
                let until = if others {
                    self.deadline.min(now + FAILOVER_AFTER)
                } else {
                    self.deadline
                };
                Choice::Dial { peer, until }
            }
        }
    }

    /// No answer came by the time [`Choice`] said: at the deadline the dial times out,
    /// before it every peer tried becomes suspect (chosen last until it is heard from again).
    pub(crate) fn unanswered(&self, shoot: &mut Shoot, now: Instant) -> Unanswered {
        if now >= self.deadline {
            return Unanswered::Timeout;
        }
        let mut newly = Vec::new();
        for &peer in &self.tried {
            if let Some(p) = shoot.peers.get_mut(peer)
                && !p.suspect
            {
                p.suspect = true;
                newly.push(peer);
            }
        }
        Unanswered::Suspect(newly)
    }
}

/// The best live peer for `target` not in `tried`: one with an endpoint if there is any, else
/// one without.
fn next_live(shoot: &Shoot, target: IpAddr, now: Instant, tried: &[usize]) -> Option<usize> {
    let best = |skip: &[usize]| {
        shoot
            .best_peer_except(now, target, skip)
            .filter(|i| shoot.peers[*i].live(now))
    };
    let nowhere = shoot
        .peers
        .iter()
        .enumerate()
        .filter(|(_, p)| p.endpoint.is_none());
    let skip: Vec<usize> = tried
        .iter()
        .copied()
        .chain(nowhere.map(|(i, _)| i))
        .collect();
    best(&skip).or_else(|| best(tried))
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::tunnel::device::Keys;
    use crate::tunnel::peer::REJECT_AFTER;
    use crate::tunnel::shoot::Mode;
    use crate::tunnel::testing::{bring_up, key, net, public};

    /// The gateway's device key.
    const GW: u8 = 1;
    /// A dial's time limit.
    const TIMEOUT: Duration = Duration::from_secs(10);
    const NS: Duration = Duration::from_nanos(1);

    /// What every dial goes to.
    fn target() -> IpAddr {
        "10.250.0.10".parse().unwrap()
    }

    /// A gateway shoot whose peers are agent replicas (private key byte, `allowedIPs`), in
    /// order, none with a session yet; and the time it was made.
    fn shoot_with(replicas: &[(u8, &str)]) -> (Shoot, Instant) {
        let keys = Keys::new(key(GW));
        let peers = replicas
            .iter()
            .map(|(b, allowed)| keys.new_peer("shoot--a", public(key(*b)), &[net(allowed)], None))
            .collect();
        let ip: IpAddr = "192.168.128.1".parse().unwrap();
        let now = Instant::now();
        let shoot = Shoot::new("shoot--a".into(), peers, &[ip], Mode::Gateway, now, 1);
        (shoot, now)
    }

    /// Replicas that all allow the whole shoot network.
    fn shoot(replicas: &[u8]) -> (Shoot, Instant) {
        let all: Vec<(u8, &str)> = replicas.iter().map(|b| (*b, "10.250.0.0/16")).collect();
        shoot_with(&all)
    }

    /// Gives replica `b` a session at `now` (and an endpoint: where it sent from).
    fn up(s: &mut Shoot, b: u8, now: Instant) {
        let from = SocketAddr::from(([10, 0, 0, b], 40000));
        bring_up(s, key(GW), key(b), from, now);
    }

    /// Mutant caught: `next_live` without its `live` filter (the best peer whatever its
    /// session): the replica with no session would be dialed second instead of the dial
    /// waiting, dialed alone instead of failing, and would count as another peer to fail
    /// over to (a head start for the first attempt).
    #[test]
    fn a_peer_with_no_live_session_is_never_dialed() {
        let (mut s, now) = shoot(&[2, 3]);
        up(&mut s, 3, now);
        let deadline = now + TIMEOUT;
        let mut f = Failover::new(deadline);
        assert_eq!(
            f.choose(&s, target(), now),
            Choice::Dial {
                peer: 1,
                until: deadline
            }
        );
        assert_eq!(
            f.choose(&s, target(), now),
            Choice::Wait { until: deadline }
        );

        let (s, now) = shoot(&[2]);
        let mut f = Failover::new(now + TIMEOUT);
        assert_eq!(f.choose(&s, target(), now), Choice::NoLivePeer);
    }

    /// A session is dialed through until REJECT_AFTER after its handshake, and not at it.
    /// Mutant caught: `<` turned into `<=` in `Peer::live` (a session at exactly
    /// REJECT_AFTER, which the peer rejects, would still be dialed through); and the bound
    /// left out (the expired session dialed at REJECT_AFTER).
    #[test]
    fn a_session_is_dialed_through_until_reject_after_and_not_at_it() {
        let (mut s, t0) = shoot(&[2]);
        up(&mut s, 2, t0);
        let before = t0 + REJECT_AFTER - NS;
        let mut f = Failover::new(before + TIMEOUT);
        assert_eq!(
            f.choose(&s, target(), before),
            Choice::Dial {
                peer: 0,
                until: before + TIMEOUT
            }
        );
        let at = t0 + REJECT_AFTER;
        let mut f = Failover::new(at + TIMEOUT);
        assert_eq!(f.choose(&s, target(), at), Choice::NoLivePeer);
    }

    /// Peer 0 ranks first (equal in all else, the first in the table), but its stream
    /// endpoint ended: it has nowhere to send until it is heard from again.
    /// Mutants caught: the `nowhere` skip left out (peer 0 dialed first, its SYN dropped);
    /// the fallback to peers without an endpoint left out (peer 0 never dialed: the dial
    /// waits on peer 1 alone).
    #[test]
    fn a_live_peer_with_nowhere_to_send_is_tried_last() {
        let (mut s, now) = shoot(&[2, 3]);
        up(&mut s, 2, now);
        up(&mut s, 3, now);
        s.peers[0].endpoint = None;
        let deadline = now + TIMEOUT;
        let mut f = Failover::new(deadline);
        assert_eq!(
            f.choose(&s, target(), now),
            Choice::Dial {
                peer: 1,
                until: now + FAILOVER_AFTER
            }
        );
        assert_eq!(
            f.choose(&s, target(), now),
            Choice::Dial {
                peer: 0,
                until: deadline
            }
        );
        assert_eq!(
            f.choose(&s, target(), now),
            Choice::Wait { until: deadline }
        );
    }

    /// The head start: FAILOVER_AFTER while another live peer is left to try, bounded by the
    /// deadline (just inside and just outside it), none for the last peer.
    /// Mutants caught: `others` always false (the next replica joins only at the deadline,
    /// so a dead replica that looks live fails the dial); `others` always true (the last
    /// attempt wakes the dial for nothing); `.min(deadline)` left out (a head start that
    /// outlasts the dial's deadline).
    #[test]
    fn an_attempt_waits_alone_for_failover_after_only_while_another_live_peer_is_left() {
        let (mut s, now) = shoot(&[2, 3]);
        up(&mut s, 2, now);
        up(&mut s, 3, now);
        let deadline = now + TIMEOUT;
        let mut f = Failover::new(deadline);
        assert_eq!(
            f.choose(&s, target(), now),
            Choice::Dial {
                peer: 0,
                until: now + FAILOVER_AFTER
            }
        );
        let later = now + FAILOVER_AFTER;
        assert_eq!(
            f.choose(&s, target(), later),
            Choice::Dial {
                peer: 1,
                until: deadline
            }
        );

        let short = now + FAILOVER_AFTER - NS;
        let mut f = Failover::new(short);
        assert_eq!(
            f.choose(&s, target(), now),
            Choice::Dial {
                peer: 0,
                until: short
            }
        );
        let long = now + FAILOVER_AFTER + NS;
        let mut f = Failover::new(long);
        assert_eq!(
            f.choose(&s, target(), now),
            Choice::Dial {
                peer: 0,
                until: now + FAILOVER_AFTER
            }
        );
    }

    /// Unanswered before the deadline (up to 1 ns before it), the peers tried become suspect
    /// (once) and the next dial goes through another replica first; at the deadline the dial
    /// times out.
    /// Mutants caught: `>=` turned into `>` in the deadline check (at the deadline the dial
    /// waits again instead of failing); the suspect mark left out (the next dial goes
    /// through the unanswering replica first again); every peer marked, not the tried ones.
    #[test]
    fn unanswered_before_the_deadline_suspects_the_peers_tried_and_at_it_times_out() {
        let (mut s, now) = shoot(&[2, 3]);
        up(&mut s, 2, now);
        up(&mut s, 3, now);
        let deadline = now + TIMEOUT;
        let mut f = Failover::new(deadline);
        assert!(matches!(
            f.choose(&s, target(), now),
            Choice::Dial { peer: 0, .. }
        ));
        assert_eq!(
            f.unanswered(&mut s, now + FAILOVER_AFTER),
            Unanswered::Suspect(vec![0])
        );
        assert!(s.peers[0].suspect);
        assert!(!s.peers[1].suspect);
        assert_eq!(
            f.unanswered(&mut s, deadline - NS),
            Unanswered::Suspect(Vec::new())
        );
        assert_eq!(f.unanswered(&mut s, deadline), Unanswered::Timeout);

        let mut f = Failover::new(deadline);
        assert!(matches!(
            f.choose(&s, target(), now),
            Choice::Dial { peer: 1, .. }
        ));
    }

    /// Among live peers, today's order: the most specific `allowedIPs` first, then the one
    /// carrying the fewest flows.
    /// Mutants caught: the prefix length left out of the rank (peer 0, first in the table,
    /// would win); the flow count's order turned around (the busier replica first).
    #[test]
    fn live_peers_go_most_specific_first_then_least_loaded() {
        let (mut s, now) = shoot_with(&[(2, "10.250.0.0/16"), (3, "10.250.0.0/24")]);
        up(&mut s, 2, now);
        up(&mut s, 3, now);
        let mut f = Failover::new(now + TIMEOUT);
        assert!(matches!(
            f.choose(&s, target(), now),
            Choice::Dial { peer: 1, .. }
        ));

        let (mut s, now) = shoot(&[2, 3]);
        up(&mut s, 2, now);
        up(&mut s, 3, now);
        let busy = s.peers[0].key;
        s.stack
            .connect("10.250.0.20:443".parse().unwrap(), Some(busy))
            .unwrap();
        let mut f = Failover::new(now + TIMEOUT);
        assert!(matches!(
            f.choose(&s, target(), now),
            Choice::Dial { peer: 1, .. }
        ));
    }
}
