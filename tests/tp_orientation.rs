//! The tensor-parallel preset's cut of routed experts follows each family's storage
//! orientation (issue 31): a column-parallel role (gate, up) keeps the `k`-th of `n` of
//! its output dimension, the row-parallel down the `k`-th of `n` of its input dimension.
//! For `[out, in]` that is rows and columns; DBRX stores `ffn.experts.mlp.w2` as
//! `[E·I, H]` applied as `x @ W`, so its down keeps rows of each expert's `I` block.
//! Every fixture family with experts, against numpy's own cut (`tensors.json`), here by
//! plain index arithmetic from this file's table of how each family stores its roles;
//! the families whose experts the preset cannot cut are refused by name.
#![cfg(feature = "model")]

mod common;

use common::{fixtures, numpy_tensors, open_fixture};

use numapin::NodeSet;
use numapin::model::{
    Checkpoint, DenseLayout, Orientation, PieceRole, PlacedModel, PlacementPlan, SliceAxis,
};
use numapin::store::{Layout, StoreOptions};

fn plan(nodes: NodeSet, k: u64, n: u64) -> PlacementPlan {
    PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes))
        .tensor_parallel(k, n)
        .unwrap()
}

fn options() -> StoreOptions {
    StoreOptions::default().loader_threads(2)
}

/// This test's own table: (expert tensor's role word, whether the family stores it
/// `[in, out]`), from the families' modelling code (transformers' `DbrxExpertGLU`:
/// `x @ w1.T`, `x @ v1.T`, `h @ w2`).
fn role_of(tensor: &str) -> Option<(bool, bool)> {
    let words: Vec<&str> = tensor.split('.').collect();
    let last = |k: usize| words[words.len() - k];
    if tensor.contains(".experts.mlp.") {
        return Some(match last(1) {
            "w1" | "v1" => (false, false),
            "w2" => (true, true),
            other => panic!("{other}"),
        });
    }
    if !tensor.contains(".experts.") {
        return None;
    }
    // …experts.{E}.{role}.weight(_scale_inv)
    match last(2) {
        "gate_proj" | "up_proj" | "w1" | "w3" => Some((false, false)),
        "down_proj" | "w2" => Some((true, false)),
        _ => None,
    }
}

/// numpy's cut of one expert's `[a, b]` part (`bytes`): `k`-th of `n` rows or of each
/// row's columns.
fn cut(bytes: &[u8], shape: [usize; 2], axis: SliceAxis, k: usize, n: usize) -> Vec<u8> {
    let row = bytes.len() / shape[0];
    match axis {
        SliceAxis::Rows => {
            let per = shape[0] / n;
            bytes[k * per * row..(k + 1) * per * row].to_vec()
        }
        SliceAxis::Columns => {
            let per = row / n;
            bytes
                .chunks(row)
                .flat_map(|r| r[k * per..(k + 1) * per].to_vec())
                .collect()
        }
    }
}

/// Checks every expert tensor of the family against numpy's cut, on both ranks; returns
/// (weights checked, down weights checked).
fn check_family(dir: &std::path::Path, name: &str, ranks: &[PlacedModel]) -> (usize, usize) {
    let n = ranks.len();
    let numpy = numpy_tensors(&dir.join(name));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(name).join("fixture.json")).unwrap())
            .unwrap();
    let experts_of = |layer: usize| json["layers"][layer.to_string()].as_u64().unwrap() as usize;
    let (mut weights, mut downs) = (0, 0);
    for (tensor, shape, bytes) in &numpy {
        let Some((down, input_first)) = role_of(tensor) else {
            continue;
        };
        let class = ranks[0].tensor(tensor).unwrap();
        let layer = class.layer().unwrap();
        // One expert's parts: a per-expert tensor is one; DBRX's [E·I, H] has E.
        let flattened = tensor.contains(".experts.mlp.");
        let experts: Vec<usize> = if flattened {
            (0..experts_of(layer)).collect()
        } else {
            let words: Vec<&str> = tensor.split('.').collect();
            let at = words.iter().position(|w| *w == "experts").unwrap();
            vec![words[at + 1].parse().unwrap()]
        };
        let parts = if flattened { experts.len() } else { 1 };
        let part_shape = [shape[0] as usize / parts, shape[1] as usize];
        let part_bytes = bytes.len() / parts;
        // The output dimension is outermost in [out, in], innermost in [in, out]; gate
        // and up keep part of it, down part of the input dimension.
        let axis = match (down, input_first) {
            (false, false) | (true, true) => SliceAxis::Rows,
            (true, false) | (false, true) => SliceAxis::Columns,
        };
        for (i, &e) in experts.iter().enumerate() {
            let part = &bytes[i * part_bytes..(i + 1) * part_bytes];
            for (k, model) in ranks.iter().enumerate() {
                let pieces = model.expert(layer, e).unwrap();
                let piece = pieces.iter().find(|p| p.tensor == tensor).unwrap();
                let want = cut(part, part_shape, axis, k, n);
                let mut want_shape = vec![part_shape[0] as u64, part_shape[1] as u64];
                match axis {
                    SliceAxis::Rows => want_shape[0] /= n as u64,
                    SliceAxis::Columns => want_shape[1] /= n as u64,
                }
                assert_eq!(
                    piece.shape, want_shape,
                    "{name} {tensor} expert {e} rank {k}"
                );
                assert!(
                    piece.bytes == &want[..],
                    "{name} {tensor} expert {e} rank {k}: not numpy's {} {k}/{n}",
                    axis.name()
                );
                if !flattened {
                    // The same part by the tensor's name (issue 31 item 1).
                    let view = model.tensor(tensor).unwrap();
                    assert_eq!(view.shape(), &want_shape[..], "{name} {tensor} by name");
                    assert!(
                        view.held_bytes().unwrap() == &want[..],
                        "{name} {tensor} rank {k}: by name, not numpy's cut"
                    );
                }
                if piece.slot == PieceRole::Weight {
                    weights += 1;
                    downs += usize::from(down);
                }
            }
        }
    }
    (weights, downs)
}

#[test]
fn tp_cuts_each_familys_experts_on_its_own_axes() {
    let Some(dir) = fixtures("tp_cuts_each_familys_experts_on_its_own_axes") else {
        return;
    };
    let nodes = common::nodes();
    // (fixture, the naming preset it exercises, the orientation of each weight role).
    let families: [(&str, &str, &[Orientation]); 6] = [
        ("st-sharded", "per-expert", &[Orientation::OutIn; 3]),
        ("st-mixtral", "mixtral", &[Orientation::OutIn; 3]),
        ("fam-qwen35-moe", "generic", &[Orientation::OutIn; 3]),
        ("fam-jamba", "generic", &[Orientation::OutIn; 3]),
        ("fam-lfm2-moe", "generic", &[Orientation::OutIn; 3]),
        (
            "fam-dbrx",
            "generic",
            &[Orientation::OutIn, Orientation::OutIn, Orientation::InOut],
        ),
    ];
    for (name, naming, orientations) in families {
        let checkpoint = open_fixture(&dir, name);
        check_orientations(&checkpoint, name, naming, orientations);
        for n in [2u64, 4] {
            if name == "st-sharded" && n == 4 {
                continue; // its FP8 scale blocks of 16 hold a quarter of 32 rows: refused
            }
            let ranks: Vec<PlacedModel> = (0..n)
                .map(|k| checkpoint.place(&plan(nodes, k, n), options()).unwrap())
                .collect();
            let (weights, downs) = check_family(&dir, name, &ranks);
            assert!(weights > 0 && downs > 0, "{name}: {weights} {downs}");
            for (k, model) in ranks.iter().enumerate() {
                let verify = model.verify(&checkpoint).unwrap();
                assert!(verify.verified(), "{name} rank {k}/{n}: {verify}");
            }
        }
    }
}

/// The plan's orientation of each weight role, as the naming table records it.
fn check_orientations(checkpoint: &Checkpoint, name: &str, naming: &str, want: &[Orientation]) {
    let plan = checkpoint.expert_plan().unwrap();
    assert_eq!(plan.naming(), naming, "{name}");
    for layer in plan.layers() {
        let weights: Vec<Orientation> = layer
            .roles()
            .zip(layer.orientations())
            .filter(|((r, _), _)| *r == PieceRole::Weight)
            .map(|(_, o)| *o)
            .collect();
        assert_eq!(weights, want, "{name} layer {}", layer.layer());
    }
}

/// The families the preset cannot cut are refused by name: a fused gate_up that does not
/// hold gate rows then up rows (the `fused` preset's and the generic naming's `[H, 2I]`
/// families, gpt-oss's interleaved one), and GGUF's Q8_0 down whose input dimension (its
/// columns: 32) is one block. A fused gate_up of gate rows then up rows (Granite, JetMoE)
/// is cut rows k/n of each half: placed, verified, each expert's `[2I/2, H]`.
#[test]
fn tp_refuses_what_it_cannot_cut_naming_the_role() {
    let Some(dir) = fixtures("tp_refuses_what_it_cannot_cut_naming_the_role") else {
        return;
    };
    let nodes = common::nodes();
    let cases: [(&str, &str, Orientation, &[&str]); 5] = [
        ("st-fused", "fused", Orientation::InOut, &["gate_up_proj"]),
        (
            "fam-qwen3-vl-moe",
            "generic",
            Orientation::InOut,
            &["gate_up"],
        ),
        ("fam-llama4", "generic", Orientation::InOut, &["gate_up"]),
        ("fam-gpt-oss", "generic", Orientation::InOut, &["gate_up"]),
        (
            "gguf-single",
            "gguf-merged",
            Orientation::OutIn,
            &["columns:0/2", "ffn_down_exps", "Q8_0 blocks"],
        ),
    ];
    for (name, naming, orientation, words) in cases {
        let checkpoint = open_fixture(&dir, name);
        let roles = checkpoint.expert_plan().unwrap().layers()[0]
            .roles()
            .filter(|(r, _)| *r == PieceRole::Weight)
            .count();
        check_orientations(&checkpoint, name, naming, &vec![orientation; roles]);
        let text = checkpoint
            .place(&plan(nodes, 0, 2), options())
            .unwrap_err()
            .to_string();
        for w in words {
            assert!(text.contains(w), "{name}: {w:?} not in {text}");
        }
    }
    for name in ["fam-granite-moe", "fam-granite-moe-v5", "fam-jetmoe"] {
        let checkpoint = open_fixture(&dir, name);
        let expert_plan = checkpoint.expert_plan().unwrap();
        let layer = &expert_plan.layers()[0];
        let whole = layer.experts()[0].weights()[0].len();
        let model = checkpoint.place(&plan(nodes, 1, 2), options()).unwrap();
        let verify = model.verify(&checkpoint).unwrap();
        assert!(verify.verified(), "{name}: {verify}");
        let views = model.expert(layer.layer(), 0).unwrap();
        let gate_up = views.iter().find(|v| v.canonical == "gate_up").unwrap();
        assert_eq!(2 * gate_up.bytes.len() as u64, whole, "{name}");
    }
}
