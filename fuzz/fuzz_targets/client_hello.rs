#![no_main]
//! The ClientHello parser must never panic, and its answer for a prefix must never
//! contradict its answer for the whole input.
use libfuzzer_sys::fuzz_target;
use trellis::wire::Parsed;
use trellis::wire::tls::parse_client_hello;

fuzz_target!(|data: &[u8]| {
    let limit = 4096;
    let whole = parse_client_hello(data, limit);
    if let Ok(Parsed::Complete { consumed, .. }) = &whole {
        assert!(*consumed <= data.len());
        // The complete answer is already given by exactly the consumed bytes.
        assert_eq!(parse_client_hello(&data[..*consumed], limit), whole);
    }
    if let Err(e) = &whole {
        // A rejection is final: more bytes cannot turn it into a hello.
        let mut longer = data.to_vec();
        longer.extend_from_slice(&[0u8; 16]);
        assert_eq!(parse_client_hello(&longer, limit).as_ref().err(), Some(e));
    }
});
