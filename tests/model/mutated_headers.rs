//! Mutated headers: random bytes flipped in valid ones never panic or escape the file.

use super::*;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Mutated headers per format: `NUMAPIN_FUZZ_CASES`, default 100,000 (the VM, under TCG,
/// sets 10,000).
fn cases() -> usize {
    match std::env::var("NUMAPIN_FUZZ_CASES") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("NUMAPIN_FUZZ_CASES={v:?} is not a number")),
        Err(_) => 100_000,
    }
}

/// One random edit: flip bits, overwrite a 1/2/4/8-byte field with an edge value,
/// truncate, insert or delete bytes, or patch a JSON digit.
fn mutate(rng: &mut XorShift, base: &[u8], header_end: usize) -> Vec<u8> {
    let mut bytes = base.to_vec();
    for _ in 0..1 + rng.below(3) {
        let at = rng.below(header_end.min(bytes.len()));
        match rng.below(6) {
            0 => {
                if let Some(b) = bytes.get_mut(at) {
                    *b ^= 1 << rng.below(8);
                }
            }
            1 => {
                let edges = [
                    0u64,
                    1,
                    0x7f,
                    0xff,
                    u32::MAX as u64,
                    1 << 40,
                    i64::MAX as u64,
                    u64::MAX,
                ];
                let v = if rng.below(2) == 0 {
                    edges[rng.below(edges.len())]
                } else {
                    rng.next()
                };
                let width = [1, 2, 4, 8][rng.below(4)];
                for (i, b) in v.to_le_bytes()[..width].iter().enumerate() {
                    if let Some(slot) = bytes.get_mut(at + i) {
                        *slot = *b;
                    }
                }
            }
            2 => bytes.truncate(rng.below(bytes.len() + 1)),
            3 => {
                let n = rng.below(16);
                let at = at.min(bytes.len());
                bytes.splice(at..at, (0..n).map(|_| rng.next() as u8));
            }
            4 => {
                let end = (at + rng.below(16)).min(bytes.len());
                bytes.drain(at.min(end)..end);
            }
            _ => {
                if let Some(b) = bytes.get_mut(at)
                    && b.is_ascii_digit()
                {
                    *b = b'0' + rng.below(10) as u8;
                }
            }
        }
    }
    bytes
}

fn assert_inside(tensors: &[numapin::model::TensorInfo], len: usize, case: usize) {
    for t in tensors {
        assert!(
            t.offset()
                .checked_add(t.len())
                .is_some_and(|end| end <= len as u64),
            "case {case}: {} at {}+{} outside {len} bytes",
            t.name(),
            t.offset(),
            t.len()
        );
    }
}

#[test]
fn safetensors_mutated_headers_never_panic_or_escape_the_file() {
    let header = r#"{"__metadata__":{"format":"pt"},"model.layers.1.mlp.experts.0.gate_proj.weight":{"dtype":"F16","shape":[4,2],"data_offsets":[0,16]},"model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv":{"dtype":"F32","shape":[1],"data_offsets":[16,20]},"norm":{"dtype":"BF16","shape":[6],"data_offsets":[20,32]},"e":{"dtype":"U8","shape":[0],"data_offsets":[32,32]}}"#;
    let base = st_file(header.as_bytes(), 32);
    assert_eq!(safetensors::parse(&base, "base").unwrap().len(), 4);
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let (mut accepted, mut worst) = (0, (0usize, 0usize));
    let cases = cases();
    for case in 0..cases {
        let bytes = mutate(&mut rng, &base, base.len());
        let (result, largest) = largest_allocation_during(|| safetensors::parse(&bytes, "m"));
        if let Ok(tensors) = &result {
            accepted += 1;
            assert_inside(tensors, bytes.len(), case);
        }
        worst = worst.max((largest, bytes.len()));
        assert!(
            largest <= 8 * bytes.len() + 4096,
            "case {case}: allocated {largest} for {} bytes",
            bytes.len()
        );
    }
    println!(
        "safetensors: {cases} cases, {accepted} accepted, largest single allocation {} bytes (input {} bytes)",
        worst.0, worst.1
    );
    assert!(accepted > 0 && accepted < cases);
}

#[test]
fn gguf_mutated_headers_never_panic_or_escape_the_file() {
    let mut strings = 8u32.to_le_bytes().to_vec();
    strings.extend_from_slice(&2u64.to_le_bytes());
    strings.extend(gstr("ab"));
    strings.extend(gstr(""));
    let mut nested = 9u32.to_le_bytes().to_vec();
    nested.extend_from_slice(&1u64.to_le_bytes());
    nested.extend_from_slice(&0u32.to_le_bytes());
    nested.extend_from_slice(&3u64.to_le_bytes());
    nested.extend_from_slice(&[1, 2, 3]);
    let b = GgufBuilder::new()
        .kv("u8", 0, vec![7])
        .kv("i16", 3, vec![1, 0x80])
        .kv("f64", 12, 0.5f64.to_le_bytes().to_vec())
        .kv("bool", 7, vec![1])
        .kv("general.alignment", 4, 32u32.to_le_bytes().to_vec())
        .kv("strings", 9, strings)
        .kv("nested", 9, nested);
    let base = b.bytes();
    let header_end = base.len() - b.data;
    assert_eq!(gguf::parse(&base, "base").unwrap().tensors.len(), 2);
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let (mut accepted, mut worst) = (0, (0usize, 0usize));
    let cases = cases();
    for case in 0..cases {
        let bytes = mutate(&mut rng, &base, header_end);
        let (result, largest) = largest_allocation_during(|| gguf::parse(&bytes, "m"));
        if let Ok(header) = &result {
            accepted += 1;
            assert_inside(&header.tensors, bytes.len(), case);
            assert!(header.alignment.is_power_of_two());
            for t in &header.tensors {
                assert_eq!((t.offset() - header.data_start) % header.alignment, 0);
            }
        }
        worst = worst.max((largest, bytes.len()));
        assert!(
            largest <= 8 * bytes.len() + 4096,
            "case {case}: allocated {largest} for {} bytes",
            bytes.len()
        );
    }
    println!(
        "gguf: {cases} cases, {accepted} accepted, largest single allocation {} bytes (input {} bytes)",
        worst.0, worst.1
    );
    assert!(accepted > 0 && accepted < cases);
}
