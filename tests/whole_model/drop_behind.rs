//! A whole placement under drop-behind reads each byte of a cold checkpoint from the
//! device once, whatever store reads it: one record per file for all the stores, the
//! fills in file order. Per store, as before, a dense class's fill evicted the experts
//! it read past, and the experts' store read them again.

use super::*;
use numapin::store::ReadMode;
use numapin_testkit::cache::{cached_pages, evict};
use std::collections::BTreeMap;

const TEST: &str = "drop_behind::a_whole_drop_behind_placement_reads_each_byte_once";

/// Byte `i` of tensor number `t`: a pattern no other tensor (or offset) repeats.
fn byte(t: usize, i: usize) -> u8 {
    (i as u32)
        .wrapping_mul(2_654_435_761)
        .wrapping_add((t as u32).wrapping_mul(40_503))
        .rotate_right(13) as u8
}

/// A safetensors checkpoint with Hugging Face names, `layers` layers of `experts` experts
/// (gate, up, down of `expert_bytes` bytes each), attention, norms and routers, written
/// in name order as the `safetensors` library writes them (layer 10 before layer 2,
/// expert 10 before expert 2), with sizes that leave no offset page-aligned.
fn checkpoint(path: &Path, layers: usize, experts: usize, expert_bytes: u64) {
    let mut tensors: BTreeMap<String, u64> = BTreeMap::new();
    tensors.insert("model.embed_tokens.weight".into(), (1 << 20) + 2 * 7);
    tensors.insert("lm_head.weight".into(), (1 << 20) + 2 * 3);
    tensors.insert("model.norm.weight".into(), 2 * 515);
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        for (name, bytes) in [
            ("input_layernorm.weight", 2 * 515),
            ("post_attention_layernorm.weight", 2 * 515),
            ("mlp.gate.weight", 2 * 515 * experts as u64),
            ("self_attn.q_proj.weight", 2 * 515 * 301),
            ("self_attn.k_proj.weight", 2 * 515 * 77),
            ("self_attn.v_proj.weight", 2 * 515 * 77),
            ("self_attn.o_proj.weight", 2 * 515 * 301),
        ] {
            tensors.insert(format!("{p}{name}"), bytes);
        }
        for e in 0..experts {
            for role in ["gate", "up", "down"] {
                tensors.insert(
                    format!("{p}mlp.experts.{e}.{role}_proj.weight"),
                    expert_bytes,
                );
            }
        }
    }
    let mut at = 0u64;
    let entries: Vec<String> = tensors
        .iter()
        .map(|(name, &bytes)| {
            let cols = if bytes % 1030 == 0 { 515 } else { bytes / 2 };
            let shape = [bytes / 2 / cols, cols];
            let e = format!(
                r#""{name}":{{"dtype":"BF16","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
                at + bytes
            );
            at += bytes;
            e
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    out.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    out.write_all(header.as_bytes()).unwrap();
    for (t, &bytes) in tensors.values().enumerate() {
        let data: Vec<u8> = (0..bytes as usize).map(|i| byte(t, i)).collect();
        out.write_all(&data).unwrap();
    }
    out.into_inner().unwrap().sync_all().unwrap();
}

#[test]
fn a_whole_drop_behind_placement_reads_each_byte_once() {
    if !common::alone(TEST) {
        return;
    }
    let dir = numapin_testkit::scratch::ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "whole-drop-behind",
    );
    // The code of a drop-behind placement, run once on a small checkpoint first, so that
    // its pages are in memory before the count starts.
    let warm = dir.join("warm.safetensors");
    checkpoint(&warm, 2, 3, 4099 * 2);
    // 12 layers (names sort 0, 1, 10, 11, 2, ...) of 12 experts (0, 1, 10, 11, 2, ...):
    // about 129 MiB, many times a disk's readahead window.
    let path = dir.join("model.safetensors");
    checkpoint(&path, 12, 12, 2 * 515 * 277);
    read_once(TEST, &warm, &path);
}

const GGUF_TEST: &str =
    "drop_behind::a_whole_drop_behind_placement_of_merged_experts_reads_each_byte_once";

/// The same on a GGUF file in llama.cpp's merged-expert form: each layer's gate, up and
/// down tensors (8 experts of 2.2 MB each: regions of 17.6 MB, larger than a readahead
/// window) read side by side, expert by expert. The kernel's readahead from the last gate
/// pieces runs into the up pieces read (and, before, dropped) already: with one loader a
/// cold placement of the 579 MB GGUF benchmark read 1.12x its file, with two 1.24x.
#[test]
fn a_whole_drop_behind_placement_of_merged_experts_reads_each_byte_once() {
    if !common::alone(GGUF_TEST) {
        return;
    }
    let dir = numapin_testkit::scratch::ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "whole-drop-behind-gguf",
    );
    let warm = dir.join("warm.gguf");
    merged_gguf(&warm, 1, 2, 64, 96);
    let path = dir.join("model.gguf");
    merged_gguf(&path, 4, 8, 1000, 1100);
    read_once(GGUF_TEST, &warm, &path);
}

/// A GGUF v3 file (`qwen2moe`) of `layers` layers, each an F32 norm, an F16 attention
/// projection, the router and `experts` merged F16 experts (gate and up of `ffn` rows of
/// `hidden`, down the transpose), then the head; tensor data 32-aligned after the
/// header, so few pieces start on a 512-byte boundary. Every tensor holds its own byte
/// pattern. Written here by hand (no numapin code).
pub(super) fn merged_gguf(path: &Path, layers: u64, experts: u64, hidden: u64, ffn: u64) {
    fn gstr(s: &str) -> Vec<u8> {
        let mut out = (s.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(s.as_bytes());
        out
    }
    const F32: u32 = 0;
    const F16: u32 = 1;
    let mut tensors: Vec<(String, Vec<u64>, u32)> = Vec::new();
    for l in 0..layers {
        let p = format!("blk.{l}");
        tensors.push((format!("{p}.attn_norm.weight"), vec![hidden], F32));
        tensors.push((format!("{p}.attn_q.weight"), vec![hidden, hidden], F16));
        tensors.push((
            format!("{p}.ffn_gate_inp.weight"),
            vec![hidden, experts],
            F16,
        ));
        tensors.push((
            format!("{p}.ffn_gate_exps.weight"),
            vec![hidden, ffn, experts],
            F16,
        ));
        tensors.push((
            format!("{p}.ffn_up_exps.weight"),
            vec![hidden, ffn, experts],
            F16,
        ));
        tensors.push((
            format!("{p}.ffn_down_exps.weight"),
            vec![ffn, hidden, experts],
            F16,
        ));
    }
    tensors.push(("output.weight".into(), vec![hidden, 3001], F16));
    let kvs: Vec<(&str, u32, Vec<u8>)> = vec![
        ("general.architecture", 8, gstr("qwen2moe")),
        (
            "qwen2moe.block_count",
            4,
            (layers as u32).to_le_bytes().to_vec(),
        ),
        (
            "qwen2moe.expert_count",
            4,
            (experts as u32).to_le_bytes().to_vec(),
        ),
    ];
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (key, ty, value) in &kvs {
        out.extend(gstr(key));
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(value);
    }
    let mut at = 0u64;
    let mut sizes = Vec::new();
    for (name, ne, ty) in &tensors {
        out.extend(gstr(name));
        out.extend_from_slice(&(ne.len() as u32).to_le_bytes());
        for d in ne {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&at.to_le_bytes());
        let bytes = ne.iter().product::<u64>() * if *ty == F32 { 4 } else { 2 };
        sizes.push(bytes);
        at = (at + bytes).next_multiple_of(32);
    }
    out.resize(out.len().next_multiple_of(32), 0);
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    file.write_all(&out).unwrap();
    for (t, &bytes) in sizes.iter().enumerate() {
        let data: Vec<u8> = (0..bytes as usize).map(|i| byte(t, i)).collect();
        file.write_all(&data).unwrap();
        file.write_all(&vec![0; (bytes.next_multiple_of(32) - bytes) as usize])
            .unwrap();
    }
    file.into_inner().unwrap().sync_all().unwrap();
}

/// Places `warm` under drop-behind (the placement's code then in memory), then `path`
/// cold, and checks that the device read the file once (at most 1% more), that at most
/// 2% of it stays cached, and every byte of every copy against the file's.
fn read_once(test: &str, warm: &Path, path: &Path) {
    let nodes = common::nodes();
    let options = || options().read_mode(ReadMode::DropBehind);
    let small = Checkpoint::open(warm).unwrap();
    let placed = small.place(&plan(nodes), options()).unwrap();
    drop((placed, small));
    let checkpoint = Checkpoint::open(path).unwrap();
    let file = checkpoint.files()[0].file();
    let len = file.metadata().unwrap().len();
    let Some(before) = common::cold_read_count(test, file, path) else {
        return;
    };
    let model = checkpoint.place(&plan(nodes), options()).unwrap();
    let read = common::storage_read_bytes().unwrap() - before;
    let (after, pages) = cached_pages(file).unwrap();
    assert_eq!(model.read_mode(), ReadMode::DropBehind);
    println!(
        "{test}: {read} bytes read from the device for a {len}-byte file ({:.4}x); {after} of \
         {pages} pages cached after the load",
        read as f64 / len as f64
    );
    // At least the file but its header, read before the count (else the kernel counts
    // nothing here and the bound says nothing), at most 1% more.
    assert!(
        read + (1 << 20) >= len,
        "{read} bytes read from the device, the file has {len}"
    );
    assert!(
        read as f64 <= len as f64 * 1.01,
        "{read} bytes read from the device for a {len}-byte file: some read more than once"
    );
    assert!(
        after * 50 <= pages,
        "{after} of {pages} pages cached after a drop-behind placement"
    );
    // Every byte, every copy, against the file's.
    let bytes = std::fs::read(path).unwrap();
    let mut compared = 0;
    for t in checkpoint.tensors() {
        let want = &bytes[t.offset() as usize..][..t.len() as usize];
        let view = model.tensor(t.name()).unwrap();
        let Some(held) = view.bytes() else {
            // Merged experts (`blk.L.ffn_*_exps`, `[E, …]`): expert e holds the e-th
            // of E equal runs of the tensor's bytes.
            let layer: usize = t.name()["blk.".len()..]
                .split('.')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            // GGUF states the shape innermost first: the experts are the last.
            let experts = *t.shape().last().unwrap() as usize;
            let each = want.len() / experts;
            for e in 0..experts {
                let pieces = model.expert(layer, e).unwrap();
                let piece = pieces.iter().find(|p| p.tensor == t.name()).unwrap();
                assert!(
                    piece.bytes == &want[e * each..][..each],
                    "{} expert {e}",
                    t.name()
                );
                compared += 1;
            }
            continue;
        };
        assert!(held == want, "{}", t.name());
        for (node, copy) in model.tensor_copies(t.name()).unwrap() {
            assert!(copy == want, "{} on {node:?}", t.name());
        }
        compared += 1;
    }
    assert!(compared >= checkpoint.tensors().len());
}

/// Every fixture (sharded safetensors, GGUF single and split, DeepSeek-V3 FP8) placed
/// under drop-behind, its records shared by all the stores and the fills in file order,
/// holds numpy's bytes in every copy.
#[test]
fn every_fixture_placed_under_drop_behind_equals_numpys() {
    let Some(dir) = fixtures("every_fixture_placed_under_drop_behind_equals_numpys") else {
        return;
    };
    let nodes = common::nodes();
    for name in FIXTURES {
        let checkpoint = open_fixture(&dir, name);
        for f in checkpoint.files() {
            evict(f.file()).unwrap();
        }
        let options = options().read_mode(ReadMode::DropBehind);
        let model = checkpoint.place(&plan(nodes), options).unwrap();
        assert_eq!(model.read_mode(), ReadMode::DropBehind, "{name}");
        let mut compared = 0;
        for (tensor, _, bytes) in numpy_tensors(&dir.join(name)) {
            let Some(held) = model.tensor(&tensor).unwrap().bytes() else {
                continue;
            };
            assert!(held == &bytes[..], "{name} {tensor}");
            for (node, copy) in model.tensor_copies(&tensor).unwrap() {
                assert!(copy == &bytes[..], "{name} {tensor} on {node:?}");
            }
            compared += 1;
        }
        assert!(compared > 0, "{name}");
        let verify = model.verify(&checkpoint).unwrap();
        assert!(verify.verified(), "{name}: {verify}");
    }
}
