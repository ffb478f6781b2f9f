//! Checkpoint files built byte by byte for the hostile tests: safetensors and GGUF
//! headers, the data left as a hole (sparse), so a file can claim terabytes.

use std::fs::File;
use std::path::Path;

/// Writes `head` and extends the file to `len` bytes with a hole (sparse: no blocks).
pub fn write_sparse(path: &Path, head: &[u8], len: u64) {
    std::fs::write(path, head).unwrap();
    File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len.max(head.len() as u64))
        .unwrap();
}

/// A safetensors file of `tensors` (name, dtype, shape, bytes), data contiguous in order:
/// the header, and the file's whole length (the data is a hole).
pub fn safetensors(tensors: &[(&str, &str, Vec<u64>, u64)]) -> (Vec<u8>, u64) {
    let mut at = 0u64;
    let entries: Vec<String> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let e = format!(
                r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
                at + bytes
            );
            at += bytes;
            e
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    let len = out.len() as u64 + at;
    (out, len)
}

pub fn write_st(path: &Path, tensors: &[(&str, &str, Vec<u64>, u64)]) {
    let (head, len) = safetensors(tensors);
    write_sparse(path, &head, len);
}

pub fn expert(l: usize, e: usize, p: &str) -> String {
    format!("model.layers.{l}.mlp.experts.{e}.{p}_proj.weight")
}

/// F16 [4, 4] per-expert tensors: `experts` experts of each layer, `roles` of each.
pub fn per_expert(layers: &[usize], experts: usize, roles: &[&str]) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for &l in layers {
        for e in 0..experts {
            for r in roles {
                out.push((expert(l, e, r), 32));
            }
        }
    }
    out
}

pub fn write_f16(path: &Path, tensors: &[(String, u64)]) {
    let list: Vec<(&str, &str, Vec<u64>, u64)> = tensors
        .iter()
        .map(|(n, b)| (n.as_str(), "F16", vec![4, b / 8], *b))
        .collect();
    write_st(path, &list);
}

pub fn gstr(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

pub const F32: u32 = 0;
pub const I8: u32 = 24;

/// A GGUF v3 file: `kvs` as (key, type, value bytes), `tensors` as (name, ne, ggml type,
/// bytes), each tensor's data 32-aligned after the header. The header, and the length.
pub fn gguf(
    kvs: &[(&str, u32, Vec<u8>)],
    tensors: &[(&str, Vec<u64>, u32, u64)],
) -> (Vec<u8>, u64) {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (key, ty, value) in kvs {
        out.extend_from_slice(&gstr(key));
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(value);
    }
    let mut at = 0u64;
    for (name, ne, ty, bytes) in tensors {
        out.extend_from_slice(&gstr(name));
        out.extend_from_slice(&(ne.len() as u32).to_le_bytes());
        for d in ne {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&at.to_le_bytes());
        at = (at + bytes).next_multiple_of(32);
    }
    let data_start = (out.len() as u64).next_multiple_of(32);
    out.resize(data_start as usize, 0);
    (out, data_start + at)
}
