//! `numapin place`'s text report.

use std::collections::BTreeMap;

use super::report::{LayerRolesJson, ModelJson, Purge, ShareJson};
use super::run::Run;
use crate::diag;
use crate::nodeset::NodeSet;

/// The checkpoint's part of the text report: what was packed, for the engine, verified.
pub(super) fn print_checkpoint(
    path: &std::path::Path,
    model: &ModelJson,
    report: &crate::model::ModelReport,
    verify: &crate::model::VerifyReport,
    plan: &crate::model::ExpertPlan,
    run: &Run,
) {
    outln!("numapin place: {}", path.display());
    outln!(
        "  checkpoint       {} file(s), naming {}, {} MoE layers (model layers {})",
        model.files,
        model.naming,
        report.layers,
        layer_list(&model.experts_per_layer)
    );
    print_roles(&model.layer_roles);
    if let Some(share) = &model.share {
        print_share(share);
    }
    outln!(
        "  for the engine   {} tensors, {} (not experts: read them yourself)",
        model.engine_tensors,
        gib(model.engine_bytes)
    );
    outln!(
        "  verified         {} slots re-read from the files ({} read) and equal to what \
         the plan named; every expert complete ({} roles each)",
        verify.slots,
        run.read_mode,
        plan.layers().first().map_or(0, |l| l.roles().count())
    );
}

/// `0-2,5` style list of the model layer numbers, with the experts of each when they
/// differ.
fn layer_list(layers: &BTreeMap<usize, usize>) -> String {
    let numbers: Vec<String> = layers.keys().map(usize::to_string).collect();
    let experts: std::collections::BTreeSet<&usize> = layers.values().collect();
    let experts = match experts.len() {
        1 => format!(
            "{} experts each",
            experts.iter().next().copied().unwrap_or(&0)
        ),
        _ => "experts per layer differ".into(),
    };
    format!("{}; {experts}", numbers.join(","))
}

/// One line per run of consecutive layers with the same roles and gate_up layout.
fn print_roles(layers: &BTreeMap<usize, LayerRolesJson>) {
    let mut runs: Vec<(usize, usize, &LayerRolesJson)> = Vec::new();
    for (&layer, roles) in layers {
        match runs.last_mut() {
            Some((_, last, r)) if *r == roles => *last = layer,
            _ => runs.push((layer, layer, roles)),
        }
    }
    for (first, last, r) in runs {
        let layers = if first == last {
            format!("layer {first}")
        } else {
            format!("layers {first}-{last}")
        };
        let layout = r
            .gate_up_layout
            .map(|g| format!("; gate_up {g}"))
            .unwrap_or_default();
        outln!(
            "  roles            {layers}: {}{layout}",
            r.roles.join(", ")
        );
    }
}

/// The share placed: what was asked, the experts held of each layer (once when every
/// layer holds the same), and each role's slice of the first layer.
fn print_share(share: &ShareJson) {
    outln!("  share            {}", share.share);
    let mut held = share.experts_held.iter();
    if let Some((&first, ids)) = held.next() {
        let of = share.experts_of.get(&first).copied().unwrap_or(0);
        if share.experts_held.values().all(|v| v == ids) {
            outln!("  experts held     {ids} of {of} in every MoE layer");
        } else {
            for (layer, ids) in share.experts_held.iter() {
                let of = share.experts_of.get(layer).copied().unwrap_or(0);
                outln!("  experts held     layer {layer}: {ids} of {of}");
            }
        }
    }
    if let Some((layer, slices)) = share.slices.iter().next() {
        for s in slices {
            let what = if s.whole {
                "whole".to_owned()
            } else if s.parts > 1 {
                let block = s.extent / s.parts;
                format!(
                    "{} {}..{} of each of {} blocks of {block}",
                    s.axis,
                    s.start,
                    s.start + s.len / s.parts,
                    s.parts
                )
            } else {
                format!(
                    "{} {}..{} of {}",
                    s.axis,
                    s.start,
                    s.start + s.len,
                    s.extent
                )
            };
            outln!(
                "  slice            layer {layer} {} {:?}: {what}",
                s.role,
                s.shape
            );
        }
    }
}

pub(super) fn print_purge(purge: Option<Purge>) {
    if let Some(p) = purge {
        outln!(
            "  jemalloc purge   RSS {} -> {} (live heap bytes {})",
            gib(p.rss_before),
            gib(p.rss_after),
            p.live_bytes
        );
    }
}

fn read_mode(r: &Run) -> String {
    match &r.read_fallback {
        Some(why) => format!("{} (fell back: {why})", r.read_mode),
        None => r.read_mode.clone(),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn pages(run: &Run) -> String {
    if run.pages_source.is_none() {
        return "unknown (no page source here)".into();
    }
    let total: u64 = run.pages_per_node.values().sum();
    let mut text = run
        .pages_per_node
        .iter()
        .map(|(n, p)| format!("N{n}={p} ({:.1}%)", 100.0 * *p as f64 / total.max(1) as f64))
        .collect::<Vec<_>>()
        .join(" ");
    if run.pages_per_node.is_empty() {
        text.push_str("no pages");
    }
    if run.pages_merged > 0 {
        text.push_str(&format!(
            " + {} in a mapping merged with a neighbour (node unknown)",
            run.pages_merged
        ));
    }
    format!("{text} (from {})", run.pages_source_name())
}

pub(super) fn print_report(
    run: &Run,
    baseline: Option<&Result<Run, String>>,
    nodes: &NodeSet,
    layout: &str,
) {
    outln!("numapin place: every slot verified");
    outln!("  nodes            {nodes} (layout {layout})");
    outln!(
        "  map limit        vm.max_map_count = {}",
        diag::max_map_count().unwrap_or(0)
    );
    let left = rows(run);
    match baseline {
        None => {
            for (name, value) in &left {
                outln!("  {name:<16} {value}");
            }
        }
        Some(b) => {
            outln!("  {:<16} {:<28} one slab per expert", "", "PinStore");
            let right = b.as_ref().map(rows).ok();
            for (i, (name, value)) in left.iter().enumerate() {
                let other = right.as_ref().map_or("-", |r| r[i].1.as_str());
                outln!("  {name:<16} {value:<28} {other}");
            }
            if let Err(e) = b {
                outln!("  baseline failed: {e}");
            }
        }
    }
}

/// Bytes per node as the layout put them (a replica or a block per node).
fn node_bytes(run: &Run) -> String {
    if run.node_bytes.is_empty() {
        return "- (no single node per tensor in this layout)".into();
    }
    run.node_bytes
        .iter()
        .map(|(n, b)| format!("N{n}={:.1} MiB", *b as f64 / (1u64 << 20) as f64))
        .collect::<Vec<_>>()
        .join(" ")
}

fn rows(r: &Run) -> Vec<(&'static str, String)> {
    vec![
        ("layers", r.layers.to_string()),
        ("experts/layer", r.experts_per_layer.to_string()),
        ("experts total", r.experts.to_string()),
        ("bytes", gib(r.bytes)),
        ("load seconds", format!("{:.3}", r.load_seconds)),
        ("load GB/s", format!("{:.2}", r.gbps())),
        ("mappings (VMAs)", r.vmas.to_string()),
        ("mbind calls", r.mbind_calls.to_string()),
        ("minor faults", r.minor_faults.to_string()),
        ("THP bytes", gib(r.anon_huge_bytes)),
        ("process RSS", gib(r.rss_bytes)),
        ("pages per node", pages(r)),
        ("bytes per node", node_bytes(r)),
        ("pages source", r.pages_source_name().to_string()),
        ("read mode", read_mode(r)),
        (
            "direct I/O",
            r.direct_io.clone().unwrap_or_else(|| "-".into()),
        ),
        ("placement", r.placement.clone()),
    ]
}
