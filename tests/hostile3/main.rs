//! Hostile checkpoints, round 3 (issue 19): incomplete experts that used to pack and be
//! called verified, lone shards, missing layers, sparse files whose headers claim
//! terabytes, a custom naming that lies, and file-chosen strings of megabytes in errors.
//! Each must end in the right value or error: never a panic, an abort or a huge
//! allocation.
//!
//! Every probe runs in a child process (this binary again, selected by
//! `NUMAPIN_HOSTILE3_ROLE`): an abort fails the probe's test with the child's status
//! instead of killing the run. The global allocator records the largest single
//! allocation of each thread, so a test can assert that nothing was reserved for what a
//! file merely claims. The probes of allocation against claimed counts are in `claims`.
#![cfg(feature = "model")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

use numapin_testkit::scratch::ScratchDir;
use std::process::Command;

use numapin::model::{Checkpoint, CustomNaming, Naming, TensorRef};
use numapin::store::{Layout as StoreLayout, PinStore, StoreOptions};
use numapin::{CheckpointFault, Error};

// ---------------------------------------------------------------------------------------
// Harness

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

const ROLE: &str = "NUMAPIN_HOSTILE3_ROLE";

/// True in the child; in the parent, runs the child, asserts it succeeded, returns false.
/// `module` is the test's `module_path!()`: the harness names a test by its path below
/// the crate (`claims::name`), and `--exact` wants that path.
fn child(module: &str, test: &str) -> bool {
    let test = &match module.split_once("::") {
        Some((_, below)) => format!("{below}::{test}"),
        None => test.to_owned(),
    };
    if std::env::var(ROLE).is_ok_and(|r| r == *test) {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, test)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "child {test} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        &stderr[..stderr.len().min(4000)]
    );
    // `--exact` with a name that is not the test's full path runs nothing and passes.
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("test result: ok. 1 passed"),
        "child {test} ran no test:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    false
}

/// The test's own directory, removed when it ends (passed or panicked): in the VM the
/// target tmp dir is ramfs, where a file left behind keeps its node's memory.
fn scratch(test: &str) -> ScratchDir {
    ScratchDir::new(
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile3"),
        test,
    )
}

fn checkpoint_fault(result: numapin::Result<impl std::fmt::Debug>) -> (CheckpointFault, Error) {
    match result {
        Err(e @ Error::Checkpoint { kind, .. }) => (kind, e),
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

mod claims;
mod files;

use files::{F32, expert, gguf, gstr, per_expert, write_f16, write_sparse};

fn store() -> PinStore {
    PinStore::new(StoreLayout::Unplaced, StoreOptions::default()).unwrap()
}

// ---------------------------------------------------------------------------------------
// 1b. Wrong bytes must never be called verified

/// llama.cpp's `convert_hf_to_gguf.py --fuse-gate-up-exps` writes `ffn_gate_up_exps`
/// beside `ffn_down_exps`. The GGUF preset used to pack `down` alone into each slot (and
/// pin_model said verified); then it was refused; now the generic naming packs each
/// expert's gate_up slice whole, then its down: the slots hold the bytes this test
/// computes from the file it wrote. A genuinely missing role (gate without up) is still
/// refused, under the preset and under the generic naming, naming layer, expert and role.
#[test]
fn gguf_fused_gate_up_packs_whole_and_a_missing_role_is_refused() {
    const NAME: &str = "gguf_fused_gate_up_packs_whole_and_a_missing_role_is_refused";
    if !child(module_path!(), NAME) {
        return;
    }
    let dir = scratch(NAME);
    let path = dir.join("fused.gguf");
    let arch = ("general.architecture", 8, gstr("qwen3moe"));
    let (head, len) = gguf(
        std::slice::from_ref(&arch),
        &[
            ("blk.1.ffn_gate_up_exps.weight", vec![4, 8, 2], F32, 256),
            ("blk.1.ffn_down_exps.weight", vec![4, 4, 2], F32, 128),
            ("blk.1.attn_q.weight", vec![4, 4], F32, 64),
        ],
    );
    let mut bytes = head.clone();
    bytes.extend((head.len() as u64..len).map(|i| (i * 7 + 3) as u8));
    std::fs::write(&path, &bytes).unwrap();
    let checkpoint = Checkpoint::open(&path).unwrap();
    let plan = checkpoint.expert_plan().unwrap();
    assert_eq!(plan.naming(), "generic");
    assert!(plan.is_complete());
    let layer = plan.layer(1).unwrap();
    assert_eq!(
        layer.roles().map(|(_, n)| n).collect::<Vec<_>>(),
        ["gate_up", "down"]
    );
    assert_eq!(
        layer.gate_up_layout(),
        Some(numapin::model::GateUpLayout::GateThenUpRows)
    );
    let packed = store();
    checkpoint.pack(&packed).unwrap();
    // Data starts right after the header; gate_up is 2 × 128 bytes, down (32-aligned
    // after it) 2 × 64.
    let data = head.len();
    for e in 0..2 {
        let mut want = bytes[data + e * 128..data + (e + 1) * 128].to_vec();
        want.extend_from_slice(&bytes[data + 256 + e * 64..data + 256 + (e + 1) * 64]);
        assert!(packed.weights(1, e).unwrap() == want, "expert {e}");
    }
    assert!(checkpoint.verify(&packed).unwrap().verified());

    // gate and down, no up: refused by the detected preset and by the generic naming.
    let path = dir.join("no-up.gguf");
    let (head, len) = gguf(
        &[arch],
        &[
            ("blk.1.ffn_gate_exps.weight", vec![4, 4, 2], F32, 128),
            ("blk.1.ffn_down_exps.weight", vec![4, 4, 2], F32, 128),
        ],
    );
    write_sparse(&path, &head, len);
    let checkpoint = Checkpoint::open(&path).unwrap();
    for (naming, role) in [
        (Naming::detect(&checkpoint).unwrap(), "no ffn_up_exps"),
        (Naming::Generic, "no up"),
    ] {
        let (kind, e) = checkpoint_fault(checkpoint.expert_plan_with(&naming));
        assert_eq!(kind, CheckpointFault::Missing, "{e}");
        let msg = e.to_string();
        assert!(msg.contains("layer 1 expert 0"), "{msg}");
        assert!(msg.contains(role), "{role:?} not in {msg}");
    }
    let store = store();
    let (kind, _) = checkpoint_fault(checkpoint.pack(&store));
    assert_eq!(kind, CheckpointFault::Missing);
    assert_eq!(store.stats().unwrap().layers, 0, "nothing packed");
}

/// A role missing from every expert (the old check only compared each expert with
/// expert 0), and scales for some weight roles only.
#[test]
fn a_role_missing_from_every_expert_is_refused() {
    const NAME: &str = "a_role_missing_from_every_expert_is_refused";
    if !child(module_path!(), NAME) {
        return;
    }
    let dir = scratch(NAME);
    let path = dir.join("no-up.safetensors");
    write_f16(&path, &per_expert(&[0], 2, &["gate", "down"]));
    let (kind, e) = checkpoint_fault(Checkpoint::open(&path).unwrap().expert_plan());
    assert_eq!(kind, CheckpointFault::Missing, "{e}");
    assert!(
        e.to_string().contains("layer 0 expert 0 has no up_proj"),
        "{e}"
    );

    // Every weight role, a scale for gate only.
    let mut tensors = per_expert(&[0], 2, &["gate", "up", "down"]);
    for e in 0..2 {
        tensors.push((expert(0, e, "gate").replace(".weight", ".weight_scale"), 8));
    }
    let path = dir.join("one-scale.safetensors");
    write_f16(&path, &tensors);
    let (kind, e) = checkpoint_fault(Checkpoint::open(&path).unwrap().expert_plan());
    assert_eq!(kind, CheckpointFault::Missing, "{e}");
    assert!(
        e.to_string().contains("expert 0 has no up_proj scale"),
        "{e}"
    );

    // Complete: packs, one slot per expert with all three pieces.
    let path = dir.join("complete.safetensors");
    write_f16(&path, &per_expert(&[0], 2, &["gate", "up", "down"]));
    let plan = Checkpoint::open(&path).unwrap().expert_plan().unwrap();
    assert_eq!(plan.layers()[0].experts().len(), 2);
    assert_eq!(plan.layers()[0].weight_bytes(), 96);
}

/// `model-00001-of-00002.safetensors` opened alone used to pack layer 0 with gate only.
/// Alone it is refused; with its index beside it, the whole set opens; a directory
/// without an index missing part 2 is refused; `-00001-of-00001` is whole.
#[test]
fn a_lone_shard_is_refused_or_opened_through_its_index() {
    const NAME: &str = "a_lone_shard_is_refused_or_opened_through_its_index";
    if !child(module_path!(), NAME) {
        return;
    }
    let dir = scratch(NAME);
    let first = dir.join("model-00001-of-00002.safetensors");
    let second = dir.join("model-00002-of-00002.safetensors");
    write_f16(&first, &per_expert(&[0], 2, &["gate", "up"]));
    let (kind, e) = checkpoint_fault(Checkpoint::open(&first));
    assert_eq!(kind, CheckpointFault::Split, "{e}");
    assert!(e.to_string().contains("part 1 of 2"), "{e}");
    // The directory without part 2 and without an index.
    let (kind, e) = checkpoint_fault(Checkpoint::open(&dir));
    assert_eq!(kind, CheckpointFault::Missing, "{e}");
    assert!(e.to_string().contains("part 2 of 2"), "{e}");

    write_f16(&second, &per_expert(&[0], 2, &["down"]));
    let index: String = per_expert(&[0], 2, &["gate", "up", "down"])
        .iter()
        .map(|(n, _)| {
            let shard = if n.contains("down") { 2 } else { 1 };
            format!(r#""{n}":"model-0000{shard}-of-00002.safetensors""#)
        })
        .collect::<Vec<_>>()
        .join(",");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        format!(r#"{{"weight_map":{{{index}}}}}"#),
    )
    .unwrap();
    let checkpoint = Checkpoint::open(&first).unwrap();
    assert_eq!(checkpoint.files().len(), 2);
    let plan = checkpoint.expert_plan().unwrap();
    assert_eq!(plan.layers()[0].weight_bytes(), 96);

    let scratch_dir = scratch(&format!("{NAME}-whole"));
    let whole = scratch_dir.join("model-00001-of-00001.safetensors");
    write_f16(&whole, &per_expert(&[0], 2, &["gate", "up", "down"]));
    assert_eq!(
        Checkpoint::open(&whole)
            .unwrap()
            .expert_plan()
            .unwrap()
            .layers()
            .len(),
        1
    );
}

/// `config.json` beside the files says which layers are MoE layers and how many experts
/// each has: a missing layer and a short layer are named. Hostile configs give no check,
/// quickly and without a large allocation.
#[test]
fn config_json_names_a_missing_moe_layer() {
    const NAME: &str = "config_json_names_a_missing_moe_layer";
    if !child(module_path!(), NAME) {
        return;
    }
    let dir = scratch(NAME);
    write_f16(
        &dir.join("model.safetensors"),
        &per_expert(&[1, 3], 2, &["gate", "up", "down"]),
    );
    let config = dir.join("config.json");
    let plan_with = |json: &str| {
        std::fs::write(&config, json).unwrap();
        Checkpoint::open(&dir).unwrap().expert_plan()
    };
    let (kind, e) = checkpoint_fault(plan_with(
        r#"{"num_hidden_layers":4,"first_k_dense_replace":1,"n_routed_experts":2}"#,
    ));
    assert_eq!(kind, CheckpointFault::Missing, "{e}");
    assert!(e.to_string().contains("layer 2 is a MoE layer"), "{e}");
    let (kind, e) = checkpoint_fault(plan_with(
        r#"{"num_hidden_layers":4,"decoder_sparse_step":2,"num_experts":3}"#,
    ));
    assert_eq!(kind, CheckpointFault::Missing, "{e}");
    assert!(e.to_string().contains("layer 1 has 2 experts"), "{e}");
    // Layers 1 and 3 are the MoE layers of a Qwen-style config: complete.
    let plan =
        plan_with(r#"{"num_hidden_layers":4,"decoder_sparse_step":2,"num_experts":2}"#).unwrap();
    assert_eq!(plan.layers().len(), 2);

    for json in [
        r#"{"num_hidden_layers":1e30,"num_experts":2}"#,
        r#"{"num_hidden_layers":18446744073709551615,"first_k_dense_replace":18446744073709551615,"num_experts":2}"#,
        r#"{"num_hidden_layers":"4","num_experts":"2"}"#,
        r#"{"num_hidden_layers":4,"num_experts":2,"moe_layer_freq":0}"#,
        r#"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["#,
        "\u{0}not json",
    ] {
        let (plan, largest) = largest_allocation_during(|| plan_with(json));
        assert_eq!(plan.unwrap().layers().len(), 2, "{json}");
        assert!(largest < 1 << 20, "{json}: {largest} bytes at once");
    }
    // Valid but huge: the walk stops at the first missing layer.
    let (plan, largest) = largest_allocation_during(|| {
        plan_with(
            r#"{"num_hidden_layers":18446744073709551615,"decoder_sparse_step":2,"num_experts":2}"#,
        )
    });
    let (kind, e) = checkpoint_fault(plan);
    assert_eq!(kind, CheckpointFault::Missing, "{e}");
    assert!(e.to_string().contains("layer 5 is a MoE layer"), "{e}");
    assert!(largest < 1 << 20, "{largest} bytes at once");
    // A 1 TiB sparse config.json: not read at all.
    write_sparse(&config, b"{", 1 << 40);
    let (plan, largest) = largest_allocation_during(|| Checkpoint::open(&dir)?.expert_plan());
    assert_eq!(plan.unwrap().layers().len(), 2);
    assert!(largest < 1 << 20, "{largest} bytes at once");
}

// ---------------------------------------------------------------------------------------
// 2. Allocation bounded by bytes read, not by numbers a file claims: `claims`

// ---------------------------------------------------------------------------------------
// 3a. A custom naming that lies

/// Expert `usize::MAX` overflowed `e + 1` (a panic in debug; in release, `Ok` with no
/// experts). Now an error naming the tensor; so is one expert past the ceiling. Layer
/// `usize::MAX` plans, and the store refuses to pack it, with an error.
#[test]
fn custom_naming_expert_usize_max_is_an_error_naming_the_tensor() {
    const NAME: &str = "custom_naming_expert_usize_max_is_an_error_naming_the_tensor";
    if !child(module_path!(), NAME) {
        return;
    }
    let scratch_dir = scratch(NAME);
    let path = scratch_dir.join("m.safetensors");
    write_f16(&path, &per_expert(&[0], 2, &["gate", "up", "down"]));
    let checkpoint = Checkpoint::open(&path).unwrap();
    let lying = |expert: usize| {
        Naming::Custom(CustomNaming::new("liar", move |name| {
            let r = Naming::PerExpert.classify(name)?;
            Some(TensorRef {
                expert: Some(if r.expert == Some(1) { expert } else { 0 }),
                ..r
            })
        }))
    };
    for bad in [usize::MAX, 65_536] {
        let (kind, e) = checkpoint_fault(checkpoint.expert_plan_with(&lying(bad)));
        assert_eq!(kind, CheckpointFault::Shape, "{e}");
        let Error::Checkpoint { tensor, reason, .. } = &e else {
            unreachable!()
        };
        assert!(
            tensor.as_deref().is_some_and(|t| t.contains(".experts.1.")),
            "{e}"
        );
        assert!(reason.contains(&format!("expert {bad}")), "{e}");
    }
    let top_layer = Naming::Custom(CustomNaming::new("top", |name| {
        let r = Naming::PerExpert.classify(name)?;
        Some(TensorRef {
            layer: usize::MAX,
            ..r
        })
    }));
    let plan = checkpoint.expert_plan_with(&top_layer).unwrap();
    assert_eq!(plan.layers()[0].layer(), usize::MAX);
    assert!(checkpoint.pack_with(&store(), &top_layer).is_err());
}

// ---------------------------------------------------------------------------------------
// 5. Bounded error messages

/// Every quoted file-chosen string is clipped (with its length), every list short (with
/// its count): a 4 MiB name, dtype, key, shard or value, 10 names of 1 MiB, a shape of a
/// million dimensions.
#[test]
fn errors_quote_at_most_a_few_hundred_bytes_of_what_a_file_chose() {
    const NAME: &str = "errors_quote_at_most_a_few_hundred_bytes_of_what_a_file_chose";
    if !child(module_path!(), NAME) {
        return;
    }
    let dir = scratch(NAME);
    let big = "x".repeat(4 << 20);
    let st = dir.join("m.safetensors");
    let bounded = |what: &str, e: Error| {
        let msg = e.to_string();
        assert!(msg.len() < 3000, "{what}: a {} byte message", msg.len());
        msg
    };
    let st_err = |header: String| {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.resize(out.len() + 64, 0);
        std::fs::write(&st, out).unwrap();
        Checkpoint::open(&st).and_then(|c| c.expert_plan())
    };
    let cases = [
        (
            "name",
            format!(r#"{{"{big}":{{"dtype":"XX","shape":[1],"data_offsets":[0,1]}}}}"#),
        ),
        (
            "dtype",
            format!(r#"{{"t":{{"dtype":"{big}","shape":[1],"data_offsets":[0,1]}}}}"#),
        ),
        (
            "value",
            format!(r#"{{"t":{{"dtype":"U8","shape":"{big}","data_offsets":[0,1]}}}}"#),
        ),
        ("shape", {
            let dims = vec!["1"; 1 << 20].join(",");
            format!(r#"{{"t":{{"dtype":"U8","shape":[{dims}],"data_offsets":[0,2]}}}}"#)
        }),
        ("lookalikes", {
            let names: Vec<String> = (0..10)
                .map(|i| {
                    format!(
                        r#""expert{i}{}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{}]}}"#,
                        &big[..1 << 20],
                        i + 1
                    )
                })
                .collect();
            format!("{{{}}}", names.join(","))
        }),
    ];
    for (what, header) in cases {
        let (_, e) = checkpoint_fault(st_err(header));
        let msg = bounded(what, e);
        assert!(msg.contains(" bytes)") || what == "shape", "{what}: {msg}");
    }
    // The index names a shard with a 4 MiB name.
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, format!(r#"{{"weight_map":{{"t":"{big}"}}}}"#)).unwrap();
    bounded("shard", checkpoint_fault(Checkpoint::open(&index)).1);
    // GGUF: a 4 MiB key of an unknown type; general.alignment a 4 MiB string.
    let gg = dir.join("m.gguf");
    let (head, len) = gguf(&[(&big, 99, Vec::new())], &[]);
    write_sparse(&gg, &head, len);
    bounded("key", checkpoint_fault(Checkpoint::open(&gg)).1);
    let (head, len) = gguf(&[("general.alignment", 8, gstr(&big))], &[]);
    write_sparse(&gg, &head, len);
    bounded("alignment", checkpoint_fault(Checkpoint::open(&gg)).1);
}
