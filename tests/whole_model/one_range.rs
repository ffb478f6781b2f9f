//! A split layer is one contiguous virtual range per tensor kind, bound node range by
//! node range (issue 33, item 5): every expert's slot at `first + e × stride`, so a
//! role of every expert (`WholeModel.layer(l, role)`, transformers 5's fused
//! `gate_up_proj [E, 2I, H]`) is one strided view whatever the number of nodes. On one
//! node: the address arithmetic, the adjacency of the layer's mappings in
//! `/proc/self/maps`, and the view's bytes against numpy's. In the VM (2+ nodes): one
//! mapping per node block, back to back, and every expert's pages in the view on its
//! home node, by the kernel's `move_pages`.

use super::common::{self, fixtures, numpy_tensors, open_fixture, pages_of_bytes};
use super::plan;

use numapin::model::{PieceRole, PlacedModel};
use numapin::store::{ReadMode, StoreOptions};
use numapin::{Node, NodeSet};

/// Fixtures with routed experts: per-expert tensors (safetensors, Mixtral's `w1/w2/w3`,
/// DBRX's flattened `[E·I, H]`), fused ones (GGUF `ffn_*_exps`, transformers 5's
/// `gate_up_proj`), and block scales (FP8).
const WITH_EXPERTS: [&str; 6] = [
    "st-sharded",
    "gguf-single",
    "st-mixtral",
    "fam-dbrx",
    "fam-granite-moe-v5",
    "fam-deepseek-v3-fp8",
];

/// Buffered reads: direct reads place each piece congruent to its file offset, which
/// can move a role within the slot from expert to expert (a read mode's cost, not the
/// layout's; `WholeModel.layer` refuses it by name).
fn options() -> StoreOptions {
    super::options().read_mode(ReadMode::Buffered)
}

/// One role of every expert of a layer as one strided view: its first byte, the slot
/// stride, and each expert's piece (which must start at `first + e × stride`).
struct RoleView<'a> {
    role: String,
    kind: PieceRole,
    first: usize,
    stride: usize,
    pieces: Vec<(usize, &'a [u8], String)>,
}

/// Every role of every layer of `model` as [`RoleView`]s, each checked to be at one
/// stride: the slot stride the layer's report gives for the role's kind.
fn role_views<'a>(name: &str, model: &'a PlacedModel) -> Vec<(usize, RoleView<'a>)> {
    let report = model.report().unwrap().experts.as_ref().unwrap();
    let mut out = Vec::new();
    for l in &report.layer_reports {
        let ids = model.expert_ids(l.layer).unwrap();
        assert!(ids.len() > 1, "{name} L{}: several experts", l.layer);
        let first = model.expert(l.layer, ids[0]).unwrap();
        for (r, piece) in first.iter().enumerate() {
            let stride = match piece.slot {
                PieceRole::Weight => l.weight_stride,
                PieceRole::Scale => l.scale_stride,
            };
            let start = piece.bytes.as_ptr() as usize;
            let mut pieces = Vec::new();
            for &e in &ids {
                let all = model.expert(l.layer, e).unwrap();
                let p = &all[r];
                assert_eq!(p.role, piece.role, "{name} L{} E{e}: slot order", l.layer);
                // The view's row e is exactly this piece: one stride over the layer.
                assert_eq!(
                    p.bytes.as_ptr() as usize,
                    start + e * stride,
                    "{name} L{} E{e} {}: not at first + e × stride ({stride})",
                    l.layer,
                    p.role
                );
                pieces.push((e, p.bytes, p.tensor.to_owned()));
            }
            out.push((
                l.layer,
                RoleView {
                    role: piece.role.to_owned(),
                    kind: piece.slot,
                    first: start,
                    stride,
                    pieces,
                },
            ));
        }
    }
    out
}

/// The mappings of this process (start, end) overlapping `range`, in address order.
fn mappings_over(range: std::ops::Range<usize>) -> Vec<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut out: Vec<(usize, usize)> = maps
        .lines()
        .map(|line| {
            let span = line.split_whitespace().next().unwrap();
            let (a, b) = span.split_once('-').unwrap();
            (
                usize::from_str_radix(a, 16).unwrap(),
                usize::from_str_radix(b, 16).unwrap(),
            )
        })
        .filter(|&(a, b)| a < range.end && b > range.start)
        .collect();
    out.sort_unstable();
    out
}

/// The layer's region of the view's kind (`experts × stride` from expert 0's slot) is
/// covered by mappings back to back, with no gap: one virtual range. Returns how many.
fn one_range(what: &str, view: &RoleView<'_>, slot0: usize, experts: usize) -> usize {
    let range = slot0..slot0 + experts * view.stride;
    let maps = mappings_over(range.clone());
    assert!(!maps.is_empty(), "{what}: no mapping over {range:x?}");
    assert!(
        maps[0].0 <= range.start && maps[maps.len() - 1].1 >= range.end,
        "{what}: {maps:x?} do not cover {range:x?}"
    );
    for pair in maps.windows(2) {
        assert_eq!(pair[0].1, pair[1].0, "{what}: a gap in {maps:x?}");
    }
    maps.len()
}

/// The slot of expert 0 of `layer` in the view's region (the first byte of its slot).
fn slot0(model: &PlacedModel, layer: usize, kind: PieceRole) -> usize {
    let store = model.expert_store().unwrap();
    let bytes = match kind {
        PieceRole::Weight => store.weights(layer, 0),
        PieceRole::Scale => store.scales(layer, 0),
    };
    bytes.unwrap().as_ptr() as usize
}

/// Mappings a split layer's region is bound in where placement works: one per non-empty
/// node block (expert `e` of `E` on node `e × n / E`, counted here without numapin).
fn blocks(nodes: NodeSet, experts: usize) -> usize {
    let n = nodes.len();
    (0..experts)
        .map(|e| e * n / experts)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

#[test]
fn a_split_layer_is_one_range_and_each_role_one_strided_view_of_numpys_bytes() {
    let Some(dir) =
        fixtures("a_split_layer_is_one_range_and_each_role_one_strided_view_of_numpys_bytes")
    else {
        return;
    };
    let nodes = common::nodes();
    for name in WITH_EXPERTS {
        let checkpoint = open_fixture(&dir, name);
        let model = checkpoint.place(&plan(nodes), options()).unwrap();
        let numpy: std::collections::HashMap<String, Vec<u8>> = numpy_tensors(&dir.join(name))
            .into_iter()
            .map(|(t, _, bytes)| (t, bytes))
            .collect();
        let views = role_views(name, &model);
        assert!(!views.is_empty(), "{name}: roles");
        for (layer, view) in &views {
            let experts = view.pieces.len();
            let what = format!("{name} L{layer} {}", view.role);
            let maps = one_range(&what, view, slot0(&model, *layer, view.kind), experts);
            if common::degrade_here().is_none() {
                assert_eq!(maps, blocks(nodes, experts), "{what}: one mapping a block");
            }
            assert_eq!(view.first, view.pieces[0].1.as_ptr() as usize);
            for (e, bytes, tensor) in &view.pieces {
                // numpy's bytes: a per-expert tensor whole, or expert e's e-th part of a
                // tensor holding every expert (fused, or DBRX's flattened `[E·I, H]`).
                let want = &numpy[tensor];
                let part = match want.len() {
                    n if n == bytes.len() => &want[..],
                    n if n == bytes.len() * experts => &want[e * bytes.len()..][..bytes.len()],
                    n => panic!("{what} E{e}: numpy's {tensor} is {n} bytes"),
                };
                assert!(*bytes == part, "{what} E{e}: the view's row is not numpy's");
            }
        }
        assert!(model.verify(&checkpoint).unwrap().verified(), "{name}");
    }
}

/// VM (2+ nodes): each role's one view spans the nodes, and every expert's pages in it
/// are on the node of its block, asked of the kernel page by page (`move_pages`).
#[test]
fn each_experts_pages_in_the_one_view_are_on_its_home_node() {
    let test = "each_experts_pages_in_the_one_view_are_on_its_home_node";
    let Some(nodes) = common::need_nodes(test, 2) else {
        return;
    };
    let Some(dir) = fixtures(test) else {
        return;
    };
    for name in WITH_EXPERTS {
        let checkpoint = open_fixture(&dir, name);
        let model = checkpoint.place(&plan(nodes), options()).unwrap();
        let store = model.expert_store().unwrap();
        for (layer, view) in role_views(name, &model) {
            let experts = view.pieces.len();
            let what = format!("{name} L{layer} {}", view.role);
            let maps = one_range(&what, &view, slot0(&model, layer, view.kind), experts);
            assert_eq!(maps, blocks(nodes, experts), "{what}: one mapping a block");
            assert!(maps >= 2, "{what}: the view spans several nodes");
            let mut on = std::collections::BTreeSet::new();
            for (e, bytes, _) in &view.pieces {
                // The block formula, independent of the store: expert e on node e·n/E.
                let home: Node = nodes.nth(e * nodes.len() / experts).unwrap();
                assert_eq!(
                    store.home_node(layer, *e).unwrap(),
                    Some(home),
                    "{what} E{e}"
                );
                // The view's row e: `first + e × stride`, its pages as the kernel has them.
                let row = view.first + e * view.stride;
                assert_eq!(bytes.as_ptr() as usize, row);
                let h = pages_of_bytes(bytes);
                assert!(
                    h.present() > 0 && h.on(home) == h.present(),
                    "{what} E{e}: pages {h:?}, home {home:?}"
                );
                on.insert(home);
            }
            assert_eq!(on.len(), maps, "{what}: a node per block");
        }
    }
}
