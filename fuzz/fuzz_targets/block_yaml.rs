#![no_main]
//! The block-YAML fast path must never panic, and a document it takes must read the same
//! as it does with the full YAML parser.
use libfuzzer_sys::fuzz_target;
use trellis::config::block_yaml::check_against_yaml_parser;

fuzz_target!(|data: &[u8]| {
    if let Ok(doc) = std::str::from_utf8(data) {
        if let Err(e) = check_against_yaml_parser(doc) {
            panic!("{e}");
        }
    }
});
