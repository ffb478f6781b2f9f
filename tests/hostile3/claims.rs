//! Allocation bounded by the bytes read, not by the numbers a file claims: sparse GGUF
//! files claiming 2^36 entries, merged GGUF and fused safetensors experts past the
//! ceiling, DBRX's flattened experts with a router claiming too many: each a named error
//! with nothing reserved for what was claimed.

use super::files::{I8, gguf, gstr, write_sparse, write_st};
use super::{checkpoint_fault, child, largest_allocation_during, scratch, store};
use numapin::model::Checkpoint;
use numapin::{CheckpointFault, Error};

/// A 1 TiB sparse GGUF whose header claims 2^36 key/values (then 2^35 tensor infos, then
/// one array of 2^36 strings) used to reserve a terabyte and abort. The first entry is
/// bad, so each is a quick error; nothing large was allocated.
#[test]
fn sparse_gguf_claiming_2_36_entries_reserves_nothing_for_them() {
    const NAME: &str = "sparse_gguf_claiming_2_36_entries_reserves_nothing_for_them";
    if !child(module_path!(), NAME) {
        return;
    }
    let scratch_dir = scratch(NAME);
    let path = scratch_dir.join("huge.gguf");
    let header = |tensors: u64, kvs: u64, rest: &[u8]| {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&tensors.to_le_bytes());
        out.extend_from_slice(&kvs.to_le_bytes());
        out.extend_from_slice(rest);
        out
    };
    let mut bad_kv = gstr("k");
    bad_kv.extend_from_slice(&99u32.to_le_bytes()); // no such value type
    let mut bad_tensor = gstr("t");
    bad_tensor.extend_from_slice(&99u32.to_le_bytes()); // 99 dimensions
    let mut strings = gstr("k");
    strings.extend_from_slice(&9u32.to_le_bytes()); // array
    strings.extend_from_slice(&8u32.to_le_bytes()); // of strings
    strings.extend_from_slice(&(1u64 << 36).to_le_bytes());
    strings.extend_from_slice(&u64::MAX.to_le_bytes()); // the first one absurdly long
    let mut arrays = gstr("k");
    arrays.extend_from_slice(&9u32.to_le_bytes());
    arrays.extend_from_slice(&9u32.to_le_bytes()); // of arrays
    arrays.extend_from_slice(&(1u64 << 36).to_le_bytes());
    arrays.extend_from_slice(&99u32.to_le_bytes()); // the first of an unknown type
    for (what, head) in [
        ("2^36 key/values", header(0, 1 << 36, &bad_kv)),
        ("2^35 tensors", header(1 << 35, 0, &bad_tensor)),
        ("2^36 strings", header(0, 1, &strings)),
        ("2^36 arrays", header(0, 1, &arrays)),
    ] {
        write_sparse(&path, &head, 1 << 40);
        let (result, largest) = largest_allocation_during(|| Checkpoint::open(&path));
        let (kind, e) = checkpoint_fault(result);
        assert!(
            matches!(kind, CheckpointFault::Header | CheckpointFault::Truncated),
            "{what}: {e}"
        );
        assert!(largest <= 1 << 20, "{what}: {largest} bytes at once");
    }
}

/// Merged GGUF expert tensors whose shape says 2^40 experts (a 3 TiB sparse file) used to
/// abort while planning; 65,537 experts is one over the ceiling (a real, small file);
/// 65,536 plans.
#[test]
fn merged_gguf_experts_beyond_the_ceiling_are_refused() {
    const NAME: &str = "merged_gguf_experts_beyond_the_ceiling_are_refused";
    if !child(module_path!(), NAME) {
        return;
    }
    let scratch_dir = scratch(NAME);
    let path = scratch_dir.join("experts.gguf");
    let tensors = |n: u64| {
        let (head, len) = gguf(
            &[],
            &[
                ("blk.1.ffn_gate_exps.weight", vec![1, 1, n], I8, n),
                ("blk.1.ffn_up_exps.weight", vec![1, 1, n], I8, n),
                ("blk.1.ffn_down_exps.weight", vec![1, 1, n], I8, n),
            ],
        );
        write_sparse(&path, &head, len);
        let checkpoint = Checkpoint::open(&path).unwrap();
        largest_allocation_during(|| checkpoint.expert_plan())
    };
    for n in [1u64 << 40, 65_537] {
        let (plan, largest) = tensors(n);
        let (kind, e) = checkpoint_fault(plan);
        assert_eq!(kind, CheckpointFault::Shape, "{e}");
        let Error::Checkpoint { tensor, reason, .. } = &e else {
            unreachable!()
        };
        assert!(
            tensor
                .as_deref()
                .is_some_and(|t| t.ends_with("_exps.weight")),
            "{e}"
        );
        assert!(reason.contains(&format!("{n} experts")), "{e}");
        assert!(reason.contains("at most 65536"), "{e}");
        assert!(largest < 1 << 20, "{n}: {largest} bytes at once");
    }
    let (plan, _) = tensors(65_536);
    let plan = plan.unwrap();
    assert_eq!(plan.layers()[0].experts().len(), 65_536);
    assert_eq!(plan.layers()[0].weight_bytes(), 3);
}

/// A fused safetensors expert tensor `[2^40, 1]` of U8 (a 2 TiB sparse file) used to
/// abort while planning.
#[test]
fn fused_safetensors_experts_beyond_the_ceiling_are_refused() {
    const NAME: &str = "fused_safetensors_experts_beyond_the_ceiling_are_refused";
    if !child(module_path!(), NAME) {
        return;
    }
    let scratch_dir = scratch(NAME);
    let path = scratch_dir.join("fused.safetensors");
    let n = 1u64 << 40;
    write_st(
        &path,
        &[
            (
                "model.layers.0.mlp.experts.gate_up_proj",
                "U8",
                vec![n, 1],
                n,
            ),
            ("model.layers.0.mlp.experts.down_proj", "U8", vec![n, 1], n),
        ],
    );
    let checkpoint = Checkpoint::open(&path).unwrap();
    let (plan, largest) = largest_allocation_during(|| checkpoint.expert_plan());
    let (kind, e) = checkpoint_fault(plan);
    assert_eq!(kind, CheckpointFault::Shape, "{e}");
    assert!(e.to_string().contains("1099511627776 experts"), "{e}");
    assert!(largest < 1 << 20, "{largest} bytes at once");
}

/// DBRX's flattened experts (`ffn.experts.mlp.{w1,v1,w2}`, `[E·I, H]`): E from the
/// router. A router claiming more than the ceiling, rows that do not divide into E, no
/// router and no config: each a Shape error naming the tensor, nothing allocated per
/// claimed expert, nothing packed. A consistent one packs E experts of I rows each.
#[test]
fn dbrx_flattened_experts_hostile_counts() {
    const NAME: &str = "dbrx_flattened_experts_hostile_counts";
    if !child(module_path!(), NAME) {
        return;
    }
    let dir = scratch(NAME);
    let flat = |rows: u64| {
        ["w1", "v1", "w2"].map(|w| {
            (
                format!("transformer.blocks.0.ffn.experts.mlp.{w}"),
                vec![rows, 4],
                rows * 8,
            )
        })
    };
    let router = "transformer.blocks.0.ffn.router.layer.weight";
    let cases: [(&str, Option<u64>, u64, &str); 4] = [
        ("huge", Some(70_000), 70_000, "at most 65536 experts"),
        ("uneven", Some(4), 10, "does not divide into 4 experts"),
        ("no-router", None, 8, "router.layer.weight"),
        ("ok", Some(4), 8, ""),
    ];
    for (case, experts, rows, words) in cases {
        let mut tensors: Vec<(String, &str, Vec<u64>, u64)> = flat(rows)
            .into_iter()
            .map(|(n, s, b)| (n, "F16", s, b))
            .collect();
        if let Some(e) = experts {
            tensors.push((router.to_owned(), "F16", vec![e, 4], e * 8));
        }
        let refs: Vec<(&str, &str, Vec<u64>, u64)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), *b))
            .collect();
        let path = dir.join(format!("{case}.safetensors"));
        write_st(&path, &refs);
        let checkpoint = Checkpoint::open(&path).unwrap();
        let plan = checkpoint.expert_plan();
        if words.is_empty() {
            let plan = plan.unwrap();
            assert_eq!(plan.naming(), "generic");
            let layer = plan.layer(0).unwrap();
            assert_eq!(layer.experts().len(), 4);
            assert_eq!(layer.weight_bytes(), 3 * 2 * 8);
            let w1 = &layer.experts()[3].weights()[0];
            assert_eq!(w1.len(), 16);
            continue;
        }
        let (kind, e) = checkpoint_fault(plan);
        assert_eq!(kind, CheckpointFault::Shape, "{case}: {e}");
        assert!(
            e.to_string().contains(words),
            "{case}: {words:?} not in {e}"
        );
        let store = store();
        assert!(checkpoint.pack(&store).is_err());
        assert_eq!(store.stats().unwrap().layers, 0, "{case}: nothing packed");
    }
}
