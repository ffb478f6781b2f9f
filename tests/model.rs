//! numapin::model: checkpoints written by the official writers (`NUMAPIN_FIXTURES`, made
//! by `cargo xtask fixtures`), hand-made bad headers for every fault, and mutated headers.
#![cfg(feature = "model")]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::fixtures;
use numapin::model::{
    Checkpoint, Format, GateUpLayout, GgmlType, GgufArray, GgufValue, Naming, PieceRole, gguf,
    safetensors,
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

fn pread_all(checkpoint: &Checkpoint, pieces: &[numapin::model::TensorPiece]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in pieces {
        let mut buf = vec![0u8; p.len() as usize];
        checkpoint.files()[p.file()]
            .file()
            .read_exact_at(&mut buf, p.offset())
            .expect("pread a piece");
        out.extend_from_slice(&buf);
    }
    out
}

/// Opens fixture `name`, checks it against its fixture.json and every slot against the
/// bytes numpy wrote. Returns the checkpoint for extra checks.
fn check_fixture(test: &str, name: &str) -> Option<Checkpoint> {
    let root = fixtures(test)?.join(name);
    let fixture: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("fixture.json")).expect("fixture.json"))
            .expect("fixture.json parses");
    let checkpoint = Checkpoint::open(root.join(fixture["path"].as_str().unwrap())).unwrap();

    assert_eq!(
        checkpoint.files().len() as u64,
        fixture["files"].as_u64().unwrap()
    );
    assert_eq!(
        checkpoint.tensors().len() as u64,
        fixture["tensors"].as_u64().unwrap()
    );
    for t in checkpoint.tensors() {
        let on_disk = checkpoint.files()[t.file()]
            .file()
            .metadata()
            .unwrap()
            .len();
        assert!(
            t.offset() + t.len() <= on_disk,
            "{} ends at {} past {on_disk}",
            t.name(),
            t.offset() + t.len()
        );
    }

    let naming = Naming::detect(&checkpoint).unwrap();
    assert_eq!(naming.name(), fixture["naming"].as_str().unwrap());
    let plan = checkpoint.expert_plan().unwrap();
    assert_eq!(plan.naming(), naming.name());
    assert!(plan.is_complete());
    // "roles", when given, is every role of a layer in slot order (weights, scales, biases).
    let has_scales = fixture["has_scales"].as_bool().unwrap();
    let roles = match fixture["roles"].as_array() {
        Some(names) => names.len(),
        None if naming.name() == "fused" => 2,
        None if has_scales => 6,
        None => 3,
    };
    for layer in plan.layers() {
        assert_eq!(layer.roles().count(), roles);
        if let Some(names) = fixture["roles"].as_array() {
            let names: Vec<&str> = names.iter().map(|n| n.as_str().unwrap()).collect();
            let have: Vec<&str> = layer.roles().map(|(_, n)| n).collect();
            assert_eq!(have, names, "layer {}", layer.layer());
        }
        let layout = layer.gate_up_layout().map(|l| format!("{l:?}"));
        assert_eq!(
            layout.as_deref(),
            fixture["gate_up_layout"].as_str(),
            "layer {}",
            layer.layer()
        );
    }
    let layers: BTreeMap<String, u64> = plan
        .layers()
        .iter()
        .map(|l| (l.layer().to_string(), l.experts().len() as u64))
        .collect();
    let expected: BTreeMap<String, u64> = fixture["layers"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
        .collect();
    assert_eq!(layers, expected);
    assert_eq!(
        plan.engine_tensors() as u64,
        fixture["engine_tensors"].as_u64().unwrap()
    );
    let expert_bytes: u64 = plan
        .layers()
        .iter()
        .map(|l| (l.weight_bytes() + l.scale_bytes()) * l.experts().len() as u64)
        .sum();
    let all_bytes: u64 = checkpoint.tensors().iter().map(|t| t.len()).sum();
    assert_eq!(plan.engine_bytes() + expert_bytes, all_bytes);

    let has_scales = fixture["has_scales"].as_bool().unwrap();
    let mut slots = 0;
    for layer in plan.layers() {
        for (e, expert) in layer.experts().iter().enumerate() {
            let stem = root
                .join("expected")
                .join(format!("L{}_E{e}", layer.layer()));
            let weights = pread_all(&checkpoint, expert.weights());
            let want = std::fs::read(stem.with_extension("weights.bin")).unwrap();
            assert_eq!(weights.len() as u64, layer.weight_bytes());
            assert!(
                weights == want,
                "layer {} expert {e}: weights differ",
                layer.layer()
            );
            if has_scales {
                let scales = pread_all(&checkpoint, expert.scales());
                let want = std::fs::read(stem.with_extension("scales.bin")).unwrap();
                assert_eq!(scales.len() as u64, layer.scale_bytes());
                assert!(
                    scales == want,
                    "layer {} expert {e}: scales differ",
                    layer.layer()
                );
            } else {
                assert!(expert.scales().is_empty());
                assert_eq!(layer.scale_bytes(), 0);
            }
            slots += 1;
        }
    }
    let expected_slots = std::fs::read_dir(root.join("expected"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .to_string_lossy()
                .ends_with(".weights.bin")
        })
        .count();
    assert_eq!(slots, expected_slots);
    Some(checkpoint)
}

#[test]
fn fixture_sharded_safetensors_with_a_straddling_expert() {
    let Some(checkpoint) = check_fixture("fixture_sharded_safetensors", "st-sharded") else {
        return;
    };
    assert_eq!(checkpoint.format(), Format::Safetensors);
    let plan = checkpoint.expert_plan().unwrap();
    let straddling = plan
        .layers()
        .iter()
        .flat_map(|l| l.experts())
        .filter(|e| {
            let first = e.weights()[0].file();
            e.weights()
                .iter()
                .chain(e.scales())
                .any(|p| p.file() != first)
        })
        .count();
    assert_eq!(straddling, 1, "exactly one expert straddles the two shards");
}

#[test]
fn fixture_single_safetensors_weight_scale() {
    check_fixture("fixture_single_safetensors", "st-single");
}

#[test]
fn fixture_mixtral_directory_without_index() {
    check_fixture("fixture_mixtral", "st-mixtral");
}

#[test]
fn fixture_fused_experts() {
    check_fixture("fixture_fused", "st-fused");
}

#[test]
fn fixture_gguf_q8_0_merged_experts_and_metadata() {
    let Some(checkpoint) = check_fixture("fixture_gguf", "gguf-single") else {
        return;
    };
    assert_eq!(checkpoint.format(), Format::Gguf);
    let v = |k: &str| checkpoint.metadata_value(k).cloned().unwrap();
    assert_eq!(v("fixture.u8"), GgufValue::U8(200));
    assert_eq!(v("fixture.i8"), GgufValue::I8(-100));
    assert_eq!(v("fixture.u16"), GgufValue::U16(60000));
    assert_eq!(v("fixture.i16"), GgufValue::I16(-30000));
    assert_eq!(v("fixture.u32"), GgufValue::U32(4_000_000_000));
    assert_eq!(v("fixture.i32"), GgufValue::I32(-2_000_000_000));
    assert_eq!(v("fixture.f32"), GgufValue::F32(0.5));
    assert_eq!(v("fixture.u64"), GgufValue::U64(1 << 63));
    assert_eq!(v("fixture.i64"), GgufValue::I64(-(1 << 62)));
    assert_eq!(v("fixture.f64"), GgufValue::F64(0.25));
    assert_eq!(v("fixture.bool"), GgufValue::Bool(true));
    assert_eq!(
        v("fixture.strings"),
        GgufValue::Array(GgufArray::String(vec![
            "a".into(),
            "bc".into(),
            String::new()
        ]))
    );
    let GgufValue::Array(GgufArray::Array(nested)) = v("fixture.nested") else {
        panic!("fixture.nested is {:?}", v("fixture.nested"));
    };
    assert_eq!(
        nested.iter().map(GgufArray::len).collect::<Vec<_>>(),
        [2, 1]
    );
    let exps = checkpoint.tensor("blk.1.ffn_gate_exps.weight").unwrap();
    assert_eq!(exps.dtype(), numapin::model::Dtype::Ggml(GgmlType::Q8_0));
    assert!(checkpoint.tensor("blk.1.ffn_gate_shexp.weight").is_some());
}

#[test]
fn fixture_gguf_split() {
    let Some(checkpoint) = check_fixture("fixture_gguf_split", "gguf-split") else {
        return;
    };
    let count = checkpoint.files().len() as u64;
    assert_eq!(
        checkpoint
            .metadata_value("split.count")
            .and_then(GgufValue::as_u64),
        Some(count)
    );
}

/// What `convert_hf_to_gguf.py --fuse-gate-up-exps` writes, by gguf-py's own writer:
/// `ffn_gate_up_exps` beside `ffn_down_exps`. The generic naming packs each expert's
/// gate_up slice whole (gate rows then up rows), then down: numpy's bytes in every slot.
/// The GGUF preset chosen by hand still refuses it rather than pack `down` alone.
#[test]
fn fixture_gguf_fused_gate_up_packs_whole() {
    let Some(checkpoint) = check_fixture(
        "fixture_gguf_fused_gate_up_packs_whole",
        "gguf-fused-gate-up",
    ) else {
        return;
    };
    match checkpoint.expert_plan_with(&Naming::GgufMerged) {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Missing,
            reason,
            ..
        }) => {
            assert!(
                reason.contains("layer 1 expert 0 has no ffn_gate_exps"),
                "{reason}"
            );
            assert!(reason.contains("blk.1.ffn_gate_up_exps.weight"), "{reason}");
            assert!(reason.contains("\"generic\" packs it"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

/// Each family the generic naming reads, written with its exact names and shapes by
/// `safetensors`: every slot equals numpy's bytes for that expert, the roles and the
/// gate_up layout are the family's, and the look-alikes beside the experts (routers,
/// router biases, shared experts, attention experts, a vision tower) are engine tensors.
#[test]
fn fixture_qwen35_moe_prefixed_per_expert() {
    check_fixture("fixture_qwen35_moe_prefixed_per_expert", "fam-qwen35-moe");
}

#[test]
fn fixture_qwen3_vl_moe_prefixed_gate_up_columns() {
    check_fixture(
        "fixture_qwen3_vl_moe_prefixed_gate_up_columns",
        "fam-qwen3-vl-moe",
    );
}

#[test]
fn fixture_llama4_feed_forward_fused() {
    check_fixture("fixture_llama4_feed_forward_fused", "fam-llama4");
}

#[test]
fn fixture_jamba_feed_forward_per_expert() {
    check_fixture("fixture_jamba_feed_forward_per_expert", "fam-jamba");
}

#[test]
fn fixture_lfm2_moe_w1_w3_w2_beside_expert_bias() {
    let Some(checkpoint) = check_fixture(
        "fixture_lfm2_moe_w1_w3_w2_beside_expert_bias",
        "fam-lfm2-moe",
    ) else {
        return;
    };
    assert!(
        checkpoint
            .tensor("model.layers.1.feed_forward.expert_bias")
            .is_some()
    );
}

#[test]
fn fixture_granite_moe_input_output_linear() {
    check_fixture("fixture_granite_moe_input_output_linear", "fam-granite-moe");
}

#[test]
fn fixture_granite_moe_transformers_v5() {
    check_fixture("fixture_granite_moe_transformers_v5", "fam-granite-moe-v5");
}

#[test]
fn fixture_jetmoe_beside_attention_experts() {
    let Some(checkpoint) = check_fixture("fixture_jetmoe_beside_attention_experts", "fam-jetmoe")
    else {
        return;
    };
    let plan = checkpoint.expert_plan().unwrap();
    let attention = checkpoint
        .tensors()
        .iter()
        .position(|t| t.name() == "model.layers.1.self_attention.experts.input_linear.weight")
        .unwrap();
    assert!(
        plan.layers()
            .iter()
            .flat_map(|l| l.experts())
            .flat_map(|e| e.weights())
            .all(|p| p.tensor() != attention)
    );
}

/// gpt-oss bf16: gate_up interleaved; its per-expert biases in the scale slot (gate_up's,
/// then down's).
#[test]
fn fixture_gpt_oss_interleaved_gate_up_biases_in_the_scale_slot() {
    check_fixture(
        "fixture_gpt_oss_interleaved_gate_up_biases_in_the_scale_slot",
        "fam-gpt-oss",
    );
}

/// gpt-oss's MXFP4 checkpoint: blocks in the weight slot, scales then biases in the scale
/// slot, the gate_up rows interleaved.
#[test]
fn fixture_gpt_oss_mxfp4_blocks_scales_and_biases() {
    check_fixture(
        "fixture_gpt_oss_mxfp4_blocks_scales_and_biases",
        "fam-gpt-oss-mxfp4",
    );
}

/// llama.cpp's gpt-oss GGUF: ffn_{gate,up,down}_exps.bias in the scale slot.
#[test]
fn fixture_gguf_expert_biases_in_the_scale_slot() {
    check_fixture(
        "fixture_gguf_expert_biases_in_the_scale_slot",
        "gguf-expert-biases",
    );
}

/// DeepSeek-V3 FP8: F8_E4M3 weights in the weight slot, their F32 `weight_scale_inv`
/// grids ([⌈out/128⌉, ⌈in/128⌉]) in the scale slot; layer 0 dense as config.json says.
#[test]
fn fixture_deepseek_v3_fp8_weight_and_scale_inv() {
    let Some(checkpoint) = check_fixture(
        "fixture_deepseek_v3_fp8_weight_and_scale_inv",
        "fam-deepseek-v3-fp8",
    ) else {
        return;
    };
    let dtype = |name: &str| checkpoint.tensor(name).unwrap().dtype().to_string();
    let e = "model.layers.1.mlp.experts.0";
    assert_eq!(dtype(&format!("{e}.gate_proj.weight")), "F8_E4M3");
    assert_eq!(dtype(&format!("{e}.gate_proj.weight_scale_inv")), "F32");
    let shape = |name: &str| checkpoint.tensor(name).unwrap().shape().to_vec();
    assert_eq!(shape(&format!("{e}.up_proj.weight_scale_inv")), [1, 2]);
    assert_eq!(shape(&format!("{e}.down_proj.weight_scale_inv")), [2, 1]);
}

#[test]
fn fixture_dbrx_flattened_experts() {
    check_fixture("fixture_dbrx_flattened_experts", "fam-dbrx");
}

/// The sharded fixture's first shard copied alone is refused (it holds layer 1's experts
/// 0..2 and part of 2); with its index and the other shard it opens whole, and its
/// config.json (layers 1 and 2 MoE, 4 experts) agrees with the plan.
#[test]
fn fixture_shard_opened_alone_is_refused() {
    let Some(dir) = fixtures("fixture_shard_opened_alone_is_refused") else {
        return;
    };
    let model = dir.join("st-sharded/model");
    let first = "model-00001-of-00002.safetensors";
    let alone = scratch("fixture-shard-alone");
    std::fs::copy(model.join(first), alone.join(first)).unwrap();
    let (_, kind, _, reason) = checkpoint_fault(Checkpoint::open(alone.join(first)));
    assert_eq!(kind, CheckpointFault::Split, "{reason}");
    assert!(reason.contains("part 1 of 2"), "{reason}");
    let checkpoint = Checkpoint::open(model.join(first)).unwrap();
    assert_eq!(checkpoint.files().len(), 2);
    assert!(checkpoint.expert_plan().unwrap().is_complete());
    // The same shard renamed, so that its name no longer says it is a part, with the
    // config beside it: layer 1's expert 2 lacks its up_proj (the cut is inside it):
    // refused all the same, naming it.
    let renamed = scratch("fixture-shard-renamed");
    std::fs::copy(model.join("config.json"), renamed.join("config.json")).unwrap();
    std::fs::copy(model.join(first), renamed.join("model.safetensors")).unwrap();
    match Checkpoint::open(&renamed).unwrap().expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Missing,
            reason,
            ..
        }) => assert!(
            reason.contains("layer 1 expert 2 has no up_proj"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_expert_ceiling_is_65536() {
    assert_eq!(numapin::model::MAX_EXPERTS_PER_LAYER, 65_536);
}

#[test]
fn ggml_type_table_matches_gguf_py() {
    let Some(dir) = fixtures("ggml_type_table_matches_gguf_py") else {
        return;
    };
    let sizes: BTreeMap<String, (u32, u32)> =
        serde_json::from_slice(&std::fs::read(dir.join("ggml_quant_sizes.json")).unwrap()).unwrap();
    let ours: BTreeMap<String, (u32, u32)> = GgmlType::ALL
        .iter()
        .map(|t| (t.name().to_owned(), (t.block_size(), t.type_size())))
        .collect();
    assert_eq!(ours, sizes);
}

// ---------------------------------------------------------------------------------------
// Hand-made safetensors headers

fn st_file(header: &[u8], data: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.resize(out.len() + data, 0xa5);
    out
}

fn st_fault(bytes: &[u8]) -> (CheckpointFault, Option<String>, String) {
    match safetensors::parse(&bytes.to_vec(), "test.safetensors") {
        Err(Error::Checkpoint {
            file,
            tensor,
            kind,
            reason,
        }) => {
            assert_eq!(file, "test.safetensors");
            (kind, tensor, reason)
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

const TWO: &str = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[16,24]}}"#;

#[test]
fn safetensors_valid_header_has_absolute_offsets() {
    let bytes = st_file(TWO.as_bytes(), 24);
    let tensors = safetensors::parse(&bytes, "t").unwrap();
    let header_end = 8 + TWO.len() as u64;
    let got: Vec<_> = tensors
        .iter()
        .map(|t| (t.name().to_owned(), t.offset(), t.len(), t.shape().to_vec()))
        .collect();
    assert_eq!(
        got,
        [
            ("a".to_owned(), header_end, 16, vec![2, 2]),
            ("b".to_owned(), header_end + 16, 8, vec![4])
        ]
    );
}

#[test]
fn safetensors_truncated_and_length_past_eof() {
    assert_eq!(st_fault(&[1, 2, 3]).0, CheckpointFault::Truncated);
    let mut bytes = st_file(TWO.as_bytes(), 24);
    let past = (bytes.len() as u64 - 8 + 1).to_le_bytes();
    bytes[..8].copy_from_slice(&past);
    let (kind, _, reason) = st_fault(&bytes);
    assert_eq!(kind, CheckpointFault::Truncated);
    assert!(reason.contains("past the end"), "{reason}");
}

#[test]
fn safetensors_not_utf8_and_not_json() {
    let (kind, _, reason) = st_fault(&st_file(b"{\"a\xff\":1}", 0));
    assert_eq!(kind, CheckpointFault::Header);
    assert!(reason.contains("UTF-8"), "{reason}");
    let (kind, _, reason) = st_fault(&st_file(b"{\"a\": [", 0));
    assert_eq!(kind, CheckpointFault::Header);
    assert!(reason.contains("JSON"), "{reason}");
}

fn one(dtype: &str, shape: &str, offsets: &str) -> String {
    format!(r#"{{"t":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}}}"#)
}

#[test]
fn safetensors_bad_ranges_name_the_tensor() {
    for (header, data, words) in [
        (one("F32", "[2]", "[8,0]"), 8, "reversed"),
        (one("F32", "[2]", "[0,8]"), 4, "past the 4 byte data section"),
        (
            r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#.to_owned(),
            12,
            "overlap",
        ),
    ] {
        let (kind, tensor, reason) = st_fault(&st_file(header.as_bytes(), data));
        assert_eq!(kind, CheckpointFault::Range, "{reason}");
        assert_eq!(tensor.as_deref(), Some("t"));
        assert!(reason.contains(words), "{reason}");
    }
}

#[test]
fn safetensors_size_mismatch_overflow_and_unknown_dtype() {
    let (kind, tensor, reason) = st_fault(&st_file(one("F16", "[3]", "[0,8]").as_bytes(), 8));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Size, Some("t"))
    );
    assert!(
        reason.contains("hold 8 bytes but F16 × [3] is 6"),
        "{reason}"
    );
    let huge = format!("[{},{}]", u64::MAX / 2, 4);
    let (kind, _, reason) = st_fault(&st_file(one("F32", &huge, "[0,8]").as_bytes(), 8));
    assert_eq!(kind, CheckpointFault::Size);
    assert!(reason.contains("overflows"), "{reason}");
    let (kind, tensor, reason) = st_fault(&st_file(one("F7", "[1]", "[0,1]").as_bytes(), 1));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::UnknownType, Some("t"))
    );
    assert!(reason.contains("\"F7\""), "{reason}");
}

#[test]
fn safetensors_name_twice_in_one_header() {
    let header = r#"{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    let (kind, tensor, _) = st_fault(&st_file(header.as_bytes(), 2));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Duplicate, Some("t"))
    );
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

#[test]
fn safetensors_name_twice_across_shards() {
    let dir = scratch("twice");
    let header = one("U8", "[1]", "[0,1]");
    std::fs::write(dir.join("a.safetensors"), st_file(header.as_bytes(), 1)).unwrap();
    std::fs::write(dir.join("b.safetensors"), st_file(header.as_bytes(), 1)).unwrap();
    let (file, kind, tensor, reason) = checkpoint_fault(Checkpoint::open(&dir));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Duplicate, Some("t"))
    );
    assert!(file.ends_with("b.safetensors"), "{file}");
    assert!(reason.contains("a.safetensors"), "{reason}");
}

#[test]
fn safetensors_index_naming_a_missing_shard() {
    let dir = scratch("missing-shard");
    std::fs::write(
        dir.join("s1.safetensors"),
        st_file(one("U8", "[1]", "[0,1]").as_bytes(), 1),
    )
    .unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"metadata":{},"weight_map":{"t":"s1.safetensors","u":"s2.safetensors"}}"#,
    )
    .unwrap();
    let (file, kind, tensor, reason) = checkpoint_fault(Checkpoint::open(&dir));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Missing, Some("u"))
    );
    assert!(file.ends_with("model.safetensors.index.json"));
    assert!(reason.contains("\"s2.safetensors\""), "{reason}");
}

// ---------------------------------------------------------------------------------------
// Hand-made GGUF headers

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

fn gguf_fault(bytes: &[u8]) -> (CheckpointFault, Option<String>, String) {
    match gguf::parse(&bytes.to_vec(), "test.gguf") {
        Err(Error::Checkpoint {
            file,
            tensor,
            kind,
            reason,
        }) => {
            assert_eq!(file, "test.gguf");
            (kind, tensor, reason)
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn gguf_valid_header_versions_2_and_3() {
    for version in [2, 3] {
        let mut b = GgufBuilder::new();
        b.version = version;
        let bytes = b.bytes();
        let header = gguf::parse(&bytes, "t").unwrap();
        assert_eq!(header.version, version);
        assert_eq!(header.alignment, 32);
        assert_eq!(header.data_start % 32, 0);
        let t = &header.tensors[1];
        assert_eq!(t.name(), "blk.0.ffn_gate_exps.weight");
        assert_eq!((t.offset(), t.len()), (header.data_start + 32, 4 * 34));
        assert_eq!(t.offset() + t.len(), bytes.len() as u64);
    }
}

#[test]
fn gguf_wrong_magic_and_unknown_version() {
    let mut b = GgufBuilder::new();
    b.magic = *b"GGML";
    assert_eq!(gguf_fault(&b.bytes()).0, CheckpointFault::Header);
    for version in [1, 4] {
        let mut b = GgufBuilder::new();
        b.version = version;
        let (kind, _, reason) = gguf_fault(&b.bytes());
        assert_eq!(kind, CheckpointFault::Header);
        assert!(reason.contains(&format!("version {version}")), "{reason}");
    }
}

#[test]
fn gguf_string_and_array_lengths() {
    // A string length past the end, and one absurdly large.
    let mut bytes = GgufBuilder::new().bytes();
    let at = 4 + 4 + 8 + 8; // the first key's length
    let len = bytes.len() as u64;
    bytes[at..at + 8].copy_from_slice(&len.to_le_bytes());
    let (kind, _, reason) = gguf_fault(&bytes);
    assert_eq!(kind, CheckpointFault::Truncated, "{reason}");
    bytes[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let (kind, _, reason) = gguf_fault(&bytes);
    assert_eq!(kind, CheckpointFault::Header, "{reason}");
    assert!(reason.contains("absurdly large"), "{reason}");
    // An array claiming 2^60 u32 elements.
    let mut value = 4u32.to_le_bytes().to_vec();
    value.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let b = GgufBuilder::new().kv("big", 9, value);
    let ((kind, _, reason), largest) = largest_allocation_during(|| gguf_fault(&b.bytes()));
    assert_eq!(kind, CheckpointFault::Truncated, "{reason}");
    assert!(reason.contains("big"), "{reason}");
    assert!(largest <= b.bytes().len() * 8, "allocated {largest}");
}

#[test]
fn gguf_counts_beyond_the_file() {
    for (at, what) in [(8, "tensor count"), (16, "key/value count")] {
        let mut bytes = GgufBuilder::new().bytes();
        bytes[at..at + 8].copy_from_slice(&(u64::MAX / 3).to_le_bytes());
        let (kind, _, reason) = gguf_fault(&bytes);
        assert_eq!(kind, CheckpointFault::Header, "{reason}");
        assert!(reason.contains(what), "{reason}");
    }
    let mut b = GgufBuilder::new();
    b.tensors[0].1 = vec![1; 5];
    let (kind, tensor, reason) = gguf_fault(&b.bytes());
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Header, Some("norm"))
    );
    assert!(reason.contains("5 dimensions"), "{reason}");
}

#[test]
fn gguf_unknown_type_names_it() {
    let mut b = GgufBuilder::new();
    b.tensors[0].2 = 4; // Q4_2, retired
    let (kind, tensor, reason) = gguf_fault(&b.bytes());
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::UnknownType, Some("norm"))
    );
    assert!(reason.contains("type id 4"), "{reason}");
}

#[test]
fn gguf_tensor_past_eof_misaligned_overlapping_and_partial_block() {
    let mut b = GgufBuilder::new();
    b.data -= 1;
    let (kind, tensor, reason) = gguf_fault(&b.bytes());
    assert_eq!(kind, CheckpointFault::Range, "{reason}");
    assert_eq!(tensor.as_deref(), Some("blk.0.ffn_gate_exps.weight"));
    assert!(reason.contains("past the end"), "{reason}");

    let mut b = GgufBuilder::new();
    b.tensors[1].3 = 16;
    let (kind, _, reason) = gguf_fault(&b.bytes());
    assert_eq!(kind, CheckpointFault::Range);
    assert!(
        reason.contains("not a multiple of the alignment 32"),
        "{reason}"
    );

    let mut b = GgufBuilder::new();
    b.tensors[0].1 = vec![16]; // 64 bytes of F32 from 0 reach into the next at 32
    let (kind, tensor, reason) = gguf_fault(&b.bytes());
    assert_eq!(kind, CheckpointFault::Range);
    assert_eq!(tensor.as_deref(), Some("blk.0.ffn_gate_exps.weight"));
    assert!(reason.contains("overlap"), "{reason}");

    let mut b = GgufBuilder::new();
    b.tensors[1].1 = vec![48, 2, 2];
    let (kind, _, reason) = gguf_fault(&b.bytes());
    assert_eq!(kind, CheckpointFault::Size);
    assert!(reason.contains("block size 32"), "{reason}");
}

#[test]
fn gguf_alignment_zero_or_not_a_power_of_two() {
    for bad in [0u32, 3, 48] {
        let b = GgufBuilder::new().kv("general.alignment", 4, bad.to_le_bytes().to_vec());
        let (kind, _, reason) = gguf_fault(&b.bytes());
        assert_eq!(kind, CheckpointFault::Header);
        assert!(reason.contains("power of two"), "{reason}");
    }
    let mut b = GgufBuilder::new().kv("general.alignment", 4, 64u32.to_le_bytes().to_vec());
    b.alignment = 64;
    b.tensors[1].3 = 64;
    b.data = 64 + 4 * 34;
    let header = gguf::parse(&b.bytes(), "t").unwrap();
    assert_eq!((header.alignment, header.data_start % 64), (64, 0));
}

fn split_part(no: u16, count: u16, tensors: i32, name: &str) -> Vec<u8> {
    let mut b = GgufBuilder::new()
        .kv("split.no", 2, no.to_le_bytes().to_vec())
        .kv("split.count", 2, count.to_le_bytes().to_vec())
        .kv("split.tensors.count", 5, tensors.to_le_bytes().to_vec());
    b.tensors = vec![(name.into(), vec![8], 0, 0)];
    b.data = 32;
    b.bytes()
}

#[test]
fn gguf_split_part_missing_or_disagreeing() {
    let dir = scratch("split");
    let first = dir.join("m-00001-of-00002.gguf");
    std::fs::write(&first, split_part(0, 2, 2, "a")).unwrap();
    let (_, kind, _, reason) = checkpoint_fault(Checkpoint::open(&first));
    assert_eq!(kind, CheckpointFault::Missing);
    assert!(reason.contains("m-00002-of-00002.gguf"), "{reason}");

    std::fs::write(dir.join("m-00002-of-00002.gguf"), split_part(1, 3, 2, "b")).unwrap();
    let (file, kind, _, reason) = checkpoint_fault(Checkpoint::open(&first));
    assert_eq!(kind, CheckpointFault::Split);
    assert!(file.ends_with("m-00002-of-00002.gguf"), "{file}");
    assert!(
        reason.contains("split.count is 3 but the first part says 2"),
        "{reason}"
    );

    let unkeyed = dir.join("u-00001-of-00002.gguf");
    std::fs::write(&unkeyed, GgufBuilder::new().bytes()).unwrap();
    let (_, kind, _, reason) = checkpoint_fault(Checkpoint::open(&unkeyed));
    assert_eq!(kind, CheckpointFault::Split);
    assert!(reason.contains("no split.count"), "{reason}");

    std::fs::write(dir.join("m-00002-of-00002.gguf"), split_part(1, 2, 2, "b")).unwrap();
    let checkpoint = Checkpoint::open(&first).unwrap();
    assert_eq!(checkpoint.files().len(), 2);
    assert_eq!(
        checkpoint
            .tensors()
            .iter()
            .map(|t| t.file())
            .collect::<Vec<_>>(),
        [0, 1]
    );
}

// ---------------------------------------------------------------------------------------
// Naming faults (safetensors checkpoints made here)

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

fn expert(l: usize, e: usize, p: &str) -> String {
    format!("model.layers.{l}.mlp.experts.{e}.{p}_proj.weight")
}

#[test]
fn naming_layer_missing_an_expert_and_different_shapes() {
    let dir = scratch("naming");
    let names: Vec<String> = [0, 1, 3]
        .iter()
        .flat_map(|&e| ["gate", "up", "down"].map(|p| expert(1, e, p)))
        .collect();
    let tensors: Vec<(&str, &str, &[u64])> = names
        .iter()
        .map(|n| (n.as_str(), "F16", &[4u64, 2][..]))
        .collect();
    write_st(&dir, "m.safetensors", &tensors);
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    let (kind, reason) = match checkpoint.expert_plan() {
        Err(Error::Checkpoint { kind, reason, .. }) => (kind, reason),
        other => panic!("{other:?}"),
    };
    assert_eq!(kind, CheckpointFault::Missing);
    assert!(
        reason.contains("layer 1") && reason.contains("expert 2"),
        "{reason}"
    );

    let names: Vec<String> = [0, 1]
        .iter()
        .flat_map(|&e| ["gate", "up", "down"].map(|p| expert(1, e, p)))
        .collect();
    let mut tensors: Vec<(&str, &str, &[u64])> = names
        .iter()
        .map(|n| (n.as_str(), "F16", &[4u64, 2][..]))
        .collect();
    tensors[4].2 = &[2, 4];
    write_st(&dir, "m.safetensors", &tensors);
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    match checkpoint.expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Shape,
            tensor,
            reason,
            ..
        }) => {
            assert_eq!(tensor.as_deref(), Some(names[4].as_str()));
            assert!(
                reason.contains("experts of one layer with different shapes"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// A layer with a bias must have one for each weight role; a bias whose expert count
/// disagrees with the weights' is a shape error naming it.
#[test]
fn naming_biases_complete_and_counted() {
    let dir = scratch("biases");
    let p = "model.layers.0.mlp.experts";
    let (gu, dn) = (format!("{p}.gate_up_proj"), format!("{p}.down_proj"));
    let (gub, dnb) = (format!("{gu}_bias"), format!("{dn}_bias"));
    write_st(
        &dir,
        "m.safetensors",
        &[
            (&gu, "F32", &[4, 8, 8]),
            (&dn, "F32", &[4, 4, 8]),
            (&gub, "F32", &[4, 8]),
        ],
    );
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    assert_eq!(Naming::detect(&checkpoint).unwrap().name(), "generic");
    match checkpoint.expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Missing,
            reason,
            ..
        }) => assert!(reason.contains("has no down bias"), "{reason}"),
        other => panic!("{other:?}"),
    }

    write_st(
        &dir,
        "m.safetensors",
        &[
            (&gu, "F32", &[4, 8, 8]),
            (&dn, "F32", &[4, 4, 8]),
            (&gub, "F32", &[4, 8]),
            (&dnb, "F32", &[3, 8]),
        ],
    );
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    match checkpoint.expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Shape,
            tensor,
            ..
        }) => assert_eq!(tensor.as_deref(), Some(dnb.as_str())),
        other => panic!("{other:?}"),
    }

    write_st(
        &dir,
        "m.safetensors",
        &[
            (&gu, "F32", &[4, 8, 8]),
            (&dn, "F32", &[4, 4, 8]),
            (&gub, "F32", &[4, 8]),
            (&dnb, "F32", &[4, 8]),
        ],
    );
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    let plan = checkpoint.expert_plan().unwrap();
    let layer = plan.layer(0).unwrap();
    let roles: Vec<(PieceRole, &str)> = layer.roles().collect();
    assert_eq!(
        roles,
        [
            (PieceRole::Weight, "gate_up"),
            (PieceRole::Weight, "down"),
            (PieceRole::Scale, "gate_up bias"),
            (PieceRole::Scale, "down bias"),
        ]
    );
    assert_eq!((layer.weight_bytes(), layer.scale_bytes()), (384, 64));
    assert_eq!(layer.gate_up_layout(), Some(GateUpLayout::Interleaved));
}

#[test]
fn naming_no_experts_lists_lookalikes_and_custom_naming_works() {
    let dir = scratch("no-experts");
    write_st(
        &dir,
        "m.safetensors",
        &[
            ("layers.0.moe.experts.0.fc1", "F16", &[2, 2]),
            ("layers.0.moe.experts.1.fc1", "F16", &[2, 2]),
            ("embed", "F32", &[4]),
        ],
    );
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    match checkpoint.expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::NoExperts,
            reason,
            ..
        }) => {
            assert!(reason.contains("layers.0.moe.experts.0.fc1"), "{reason}");
            assert!(reason.contains("layers.0.moe.experts.1.fc1"), "{reason}");
            assert!(!reason.contains("embed"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let naming = Naming::Custom(numapin::model::CustomNaming::new("fc1", |name| {
        let rest = name.strip_prefix("layers.")?;
        let (layer, rest) = rest.split_once(".moe.experts.")?;
        let expert = rest.strip_suffix(".fc1")?;
        Some(numapin::model::TensorRef {
            layer: layer.parse().ok()?,
            expert: Some(expert.parse().ok()?),
            piece: 0,
            scale: false,
        })
    }));
    let plan = checkpoint.expert_plan_with(&naming).unwrap();
    assert_eq!(plan.naming(), "fc1");
    assert_eq!(plan.layers().len(), 1);
    assert_eq!(plan.layers()[0].experts().len(), 2);
    assert_eq!((plan.engine_tensors(), plan.engine_bytes()), (1, 16));
    let e1 = &plan.layers()[0].experts()[1].weights()[0];
    let t = checkpoint.tensor("layers.0.moe.experts.1.fc1").unwrap();
    assert_eq!((e1.offset(), e1.len()), (t.offset(), t.len()));
}

// ---------------------------------------------------------------------------------------
// Mutated headers

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

// ---------------------------------------------------------------------------------------
// Randomized expert headers: names from the generic vocabulary (per-expert, merged,
// flattened, biases, MXFP4 blocks and scales), shapes consistent or not.

mod random_experts {
    use super::*;
    use proptest::prelude::*;

    /// One tensor: (layer, expert or merged, word, suffix or kind, dims, F32?).
    fn tensor() -> impl Strategy<Value = (String, bool, Vec<u64>)> {
        let layer = prop_oneof![0usize..3, Just(999_999_999)];
        let expert = prop_oneof![
            4 => (0usize..4).prop_map(Some),
            1 => prop_oneof![Just(65_535usize), Just(65_536), Just(999_999_999)].prop_map(Some),
            4 => Just(None),
        ];
        let word = prop::sample::select(vec![
            "gate_proj",
            "up_proj",
            "down_proj",
            "gate_up_proj",
            "w1",
            "v1",
            "w2",
            "input_linear",
            "output_linear",
        ]);
        let kind = prop::sample::select(vec![
            ".weight",
            ".weight_scale_inv",
            "_bias",
            "_blocks",
            "_scales",
            "",
            ".mlp",
        ]);
        let dims = prop::collection::vec(0u64..6, 0..4);
        (layer, expert, word, kind, dims, any::<bool>()).prop_map(
            |(layer, expert, word, kind, dims, f32)| {
                let p = format!("model.layers.{layer}.mlp");
                let name = match (expert, kind) {
                    (Some(e), _) => format!("{p}.experts.{e}.{word}{kind}"),
                    (None, ".mlp") => format!("transformer.blocks.{layer}.ffn.experts.mlp.{word}"),
                    (None, _) if word.ends_with("linear") => format!("{p}.{word}{kind}"),
                    (None, _) => format!("{p}.experts.{word}{kind}"),
                };
                (name, f32, dims)
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(192))]

        /// No panic; a plan is complete with every piece inside its file and one piece per
        /// role, or the error is a typed checkpoint error.
        #[test]
        fn random_expert_headers_plan_whole_or_fail_typed(
            tensors in prop::collection::vec(tensor(), 1..12)
        ) {
            let dir = scratch("random-experts");
            let mut seen = std::collections::BTreeSet::new();
            let tensors: Vec<(&str, &str, &[u64])> = tensors
                .iter()
                .filter(|(n, _, _)| seen.insert(n.clone()))
                .map(|(n, f32, d)| (n.as_str(), if *f32 { "F32" } else { "F16" }, d.as_slice()))
                .collect();
            write_st(&dir, "m.safetensors", &tensors);
            let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
            let file_len = checkpoint.files()[0].file().metadata().unwrap().len();
            for naming in Naming::PRESETS {
                match naming.plan(&checkpoint) {
                    Ok(plan) => {
                        prop_assert!(plan.is_complete());
                        for layer in plan.layers() {
                            prop_assert!(layer.experts().len() <= numapin::model::MAX_EXPERTS_PER_LAYER);
                            for e in layer.experts() {
                                let w: u64 = e.weights().iter().map(|p| p.len()).sum();
                                let s: u64 = e.scales().iter().map(|p| p.len()).sum();
                                prop_assert_eq!((w, s), (layer.weight_bytes(), layer.scale_bytes()));
                                for p in e.weights().iter().chain(e.scales()) {
                                    prop_assert!(p.offset() + p.len() <= file_len);
                                }
                            }
                        }
                    }
                    Err(Error::Checkpoint { .. }) => {}
                    Err(other) => prop_assert!(false, "{}: {other:?}", naming.name()),
                }
            }
        }
    }
}
