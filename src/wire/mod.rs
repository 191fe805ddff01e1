//! Sans-IO codecs for the bytes a client sends before routing: the TLS ClientHello.
//!
//! Every parser here is a pure function over a byte slice: it never reads a socket, never
//! allocates more than the value it returns, and answers "need more bytes" as a state
//! ([`Parsed::Incomplete`]), not as an error. Size caps are parameters or named constants, so
//! a driver can bound how much it buffers. Nothing in this module knows about tokio.

pub mod http;
pub mod proxy;
pub mod tls;

/// The result of feeding a parser the bytes read so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed<T> {
    /// More bytes are needed before a decision can be made.
    Incomplete,
    /// A complete value was parsed from the first `consumed` bytes of the input.
    Complete {
        /// The parsed value.
        value: T,
        /// How many input bytes the value covers.
        consumed: usize,
    },
}
