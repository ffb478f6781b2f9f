//! numapin::model: checkpoints written by the official writers (`NUMAPIN_FIXTURES`, made
//! by `cargo xtask fixtures`), hand-made bad headers for every fault, and mutated headers.
#![cfg(feature = "model")]

#[path = "../common/mod.rs"]
mod common;
mod fixtures;
mod gguf_headers;
mod mutated_headers;
mod naming_faults;
mod random_experts;
mod safetensors_headers;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::fixtures;
use numapin::model::{
    Checkpoint, ExpertPlan, Format, GateUpLayout, GgmlType, GgufArray, GgufValue, Naming,
    PieceRole, gguf, safetensors,
};
use numapin::{CheckpointFault, Error};

// ---------------------------------------------------------------------------------------
// The largest single allocation made by this thread (tests run on several threads).

struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; only records sizes in a
// const-initialised thread-local Cell (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|m| m.set(m.get().max(layout.size())));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|m| m.set(m.get().max(new_size)));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn largest_allocation_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|m| m.set(0));
    let out = f();
    (out, LARGEST.with(Cell::get))
}

// ---------------------------------------------------------------------------------------
// Fixtures

// ---------------------------------------------------------------------------------------
// Builders the modules share

fn st_file(header: &[u8], data: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.resize(out.len() + data, 0xa5);
    out
}

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("model")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn checkpoint_fault(
    result: numapin::Result<Checkpoint>,
) -> (String, CheckpointFault, Option<String>, String) {
    match result {
        Err(Error::Checkpoint {
            file,
            tensor,
            kind,
            reason,
        }) => (file, kind, tensor, reason),
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[derive(Clone)]
struct GgufBuilder {
    magic: [u8; 4],
    version: u32,
    kvs: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    alignment: u64,
    data: usize,
}

fn gstr(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

impl GgufBuilder {
    fn new() -> Self {
        GgufBuilder {
            magic: *b"GGUF",
            version: 3,
            kvs: vec![("general.architecture".into(), 8, gstr("test"))],
            tensors: vec![
                ("norm".into(), vec![8], 0, 0),
                ("blk.0.ffn_gate_exps.weight".into(), vec![32, 2, 2], 8, 32),
            ],
            alignment: 32,
            data: 32 + 4 * 34,
        }
    }

    fn kv(mut self, key: &str, ty: u32, value: Vec<u8>) -> Self {
        self.kvs.push((key.into(), ty, value));
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = self.magic.to_vec();
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, ty, v) in &self.kvs {
            out.extend(gstr(k));
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(v);
        }
        for (name, dims, ty, offset) in &self.tensors {
            out.extend(gstr(name));
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
        }
        out.resize(out.len().next_multiple_of(self.alignment as usize), 0);
        out.resize(out.len() + self.data, 0x5a);
        out
    }
}

fn write_st(dir: &Path, file: &str, tensors: &[(&str, &str, &[u64])]) {
    let mut header = String::from("{");
    let mut at = 0u64;
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        let bytes = shape.iter().product::<u64>() * if *dtype == "F32" { 4 } else { 2 };
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
            at + bytes
        ));
        at += bytes;
    }
    header.push('}');
    std::fs::write(dir.join(file), st_file(header.as_bytes(), at as usize)).unwrap();
}
