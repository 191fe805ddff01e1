//! Sockets and byte moving: listener sockets, upstream connects with failover, and the
//! duplex copy loop with half-close, idle and lifetime bounds.
//!
//! Nothing here parses protocol bytes or knows about listeners' routing rules; callers hand
//! in a route (for backend choice) and the bytes already read (to replay upstream).

pub mod relay;
pub mod socket;
pub mod upstream;
