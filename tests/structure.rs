//! A placed model's structure under one role vocabulary (issue 33, item 6): for every
//! fixture family, `locate(name)` of each tensor is what this file's own reading of the
//! name says (layer, expert, canonical role), `roles(layer)` are the canonical roles the
//! layer's tensor names carry, and `expert(l, e)`'s pieces carry the same canonical name
//! beside the file's. The reading here is a table of the families' words, written from
//! the checkpoints' modelling code, not the library's vocabulary.
#![cfg(feature = "model")]

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{fixtures, open_fixture};

use numapin::NodeSet;
use numapin::model::{DenseLayout, PlacementPlan};
use numapin::store::{Layout, StoreOptions};

const FAMILIES: &[&str] = &[
    "st-mixtral",
    "st-sharded",
    "st-fused",
    "gguf-single",
    "fam-dbrx",
    "fam-deepseek-v3-fp8",
    "fam-gpt-oss",
    "fam-gpt-oss-mxfp4",
    "fam-granite-moe",
    "fam-granite-moe-v5",
    "fam-jamba",
    "fam-jetmoe",
    "fam-lfm2-moe",
    "fam-llama4",
    "fam-qwen3-vl-moe",
    "fam-qwen35-moe",
];

/// This test's reading of a routed expert's tensor name: (layer, expert, role), the
/// role `gate`/`up`/`gate_up`/`down` with `.scale`/`.bias`; `None` for any other
/// tensor (shared experts, routers, JetMoE's attention experts).
fn expected(name: &str) -> Option<(usize, Option<usize>, String)> {
    let words: Vec<&str> = name.split('.').collect();
    let at = words
        .iter()
        .position(|w| matches!(*w, "layers" | "blocks" | "blk"))?;
    let layer: usize = words.get(at + 1)?.parse().ok()?;
    let rest = &words[at + 2..];
    // GGUF: blk.L.ffn_{role}_exps.{weight,bias}
    if let [word, kind] = rest
        && let Some(role) = word
            .strip_prefix("ffn_")
            .and_then(|w| w.strip_suffix("_exps"))
    {
        let suffix = if *kind == "bias" { ".bias" } else { "" };
        return Some((layer, None, format!("{role}{suffix}")));
    }
    let block = *rest.first()?;
    if !matches!(block, "mlp" | "feed_forward" | "block_sparse_moe" | "ffn") {
        return None; // self_attention.experts (JetMoE's attention), shared_mlp, ...
    }
    let rest = &rest[1..];
    let role = |word: &str| -> Option<&'static str> {
        Some(match word {
            "gate_proj" | "w1" => "gate",
            "up_proj" | "w3" | "v1" => "up",
            "gate_up_proj" | "input_linear" => "gate_up",
            "down_proj" | "w2" | "output_linear" => "down",
            _ => return None,
        })
    };
    match rest {
        // Granite, JetMoE: the block's input_linear / output_linear hold every expert.
        [word @ ("input_linear" | "output_linear"), "weight"] => {
            Some((layer, None, role(word)?.to_owned()))
        }
        ["experts", "mlp", word] => Some((layer, None, role(word)?.to_owned())),
        ["experts", e, word, kind] if e.parse::<usize>().is_ok() => {
            let suffix = match *kind {
                "weight" => "",
                "weight_scale" | "weight_scale_inv" => ".scale",
                _ => return None,
            };
            Some((layer, e.parse().ok(), format!("{}{suffix}", role(word)?)))
        }
        ["experts", word] | ["experts", word, "weight"] => {
            if let Some(r) = role(word) {
                return Some((layer, None, r.to_owned()));
            }
            // gpt-oss: {role}_bias, MXFP4 {role}_blocks / {role}_scales.
            for (suffix, canonical) in [("_bias", ".bias"), ("_blocks", ""), ("_scales", ".scale")]
            {
                if let Some(r) = word.strip_suffix(suffix).and_then(role) {
                    return Some((layer, None, format!("{r}{canonical}")));
                }
            }
            None
        }
        _ => None,
    }
}

#[test]
fn every_family_locates_its_expert_tensors_under_the_canonical_roles() {
    let Some(dir) = fixtures("every_family_locates_its_expert_tensors_under_the_canonical_roles")
    else {
        return;
    };
    let all = NodeSet::parse("all").unwrap();
    for family in FAMILIES {
        let checkpoint = open_fixture(&dir, family);
        let plan = PlacementPlan::new(Layout::SplitExperts(all), DenseLayout::Replicate(all));
        let model = checkpoint
            .place(&plan, StoreOptions::default().loader_threads(2))
            .unwrap_or_else(|e| panic!("{family}: {e}"));
        let mut roles_seen: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
        let mut located = 0;
        for t in checkpoint.tensors() {
            let want = expected(t.name());
            let got = model.locate(t.name()).unwrap();
            let got_tuple = got.as_ref().map(|g| (g.layer, g.expert, g.role.clone()));
            assert_eq!(got_tuple, want, "{family}: {}", t.name());
            if let Some(g) = got {
                located += 1;
                roles_seen.entry(g.layer).or_default().insert(g.role);
                // The file's own name is kept beside the canonical one.
                assert!(!g.file_role.is_empty(), "{family}: {}", t.name());
            }
        }
        assert!(located > 0, "{family}: no expert tensor located");
        let layers: Vec<usize> = roles_seen.keys().copied().collect();
        assert_eq!(model.layers(), layers, "{family}");
        for (&layer, seen) in &roles_seen {
            let roles = model.roles(layer).unwrap();
            let canonical: BTreeSet<String> =
                roles.iter().map(|r| r.canonical.to_owned()).collect();
            assert_eq!(&canonical, seen, "{family} layer {layer}");
            // Every expert's pieces carry the canonical name beside the file's, in the
            // roles' order.
            for id in model.expert_ids(layer).unwrap() {
                let pieces = model.expert(layer, id).unwrap();
                let names: Vec<(&str, &str)> =
                    pieces.iter().map(|p| (p.canonical, p.role)).collect();
                let want: Vec<(&str, &str)> = roles.iter().map(|r| (r.canonical, r.file)).collect();
                assert_eq!(names, want, "{family} layer {layer} expert {id}");
            }
        }
    }
}

#[test]
fn the_presets_and_the_generic_naming_share_one_vocabulary() {
    use numapin::model::Naming;
    let spelled = |naming: &Naming, pieces: &[(u8, bool)]| -> Vec<String> {
        pieces
            .iter()
            .map(|&(p, s)| naming.canonical_role(p, s))
            .collect()
    };
    let three = [(0, false), (1, false), (2, false), (2, true)];
    for naming in [Naming::PerExpert, Naming::Mixtral, Naming::GgufMerged] {
        assert_eq!(
            spelled(&naming, &three),
            ["gate", "up", "down", "down.scale"],
            "{}",
            naming.name()
        );
    }
    assert_eq!(
        spelled(&Naming::Fused, &[(0, false), (1, false)]),
        ["gate_up", "down"]
    );
    let bias = Naming::GENERIC_BIAS_PIECE;
    assert_eq!(
        spelled(
            &Naming::Generic,
            &[(0, false), (2, false), (3, true), (bias + 2, true)]
        ),
        ["gate", "gate_up", "down.scale", "gate_up.bias"]
    );
    // The file's own spelling stays what it was (gpt-oss's with a space).
    assert_eq!(Naming::Generic.role_name(bias + 2, true), "gate_up bias");
    assert_eq!(Naming::Mixtral.role_name(1, false), "w3");
}

#[test]
fn locate_refuses_a_name_the_checkpoint_lacks() {
    let Some(dir) = fixtures("locate_refuses_a_name_the_checkpoint_lacks") else {
        return;
    };
    let checkpoint = open_fixture(&dir, "st-mixtral");
    let plan = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced);
    let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();
    let e = model.locate("model.layers.9.block_sparse_moe.experts.0.w1.weight");
    let text = e.unwrap_err().to_string();
    assert!(
        text.contains("layers.9") && text.contains("PlacedModel::locate"),
        "{text}"
    );
    assert_eq!(
        model.locate("model.layers.1.mlp.gate.weight").unwrap(),
        None
    );
}
