#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    aether_fuzz::bundle(data);
});
