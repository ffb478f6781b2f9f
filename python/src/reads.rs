//! What a placement's direct reads did, in the Python report dict
//! (`WholeModel.report_dict()`): each measured class gets the keys `pin_model --plan
//! --json` gives it, under the same names, beside the nested `direct_reads`.

use numapin::model::{TensorClass, WholeReport};
use serde_json::{Value, json};

/// The report as JSON, each `measured` entry with `in_place_bytes`, `bounced_bytes` (the
/// routed experts': summed over their layers' reports), `uring_reads`, `blocking_reads`,
/// `uring_depth` and `blocking_depth`; and `direct_io`, how the experts' direct reads
/// were issued (`io_uring (depth N per loader)` or `threads (...; fallback: WHY)`), or
/// null when no expert was read directly.
pub fn report_value(report: Option<&WholeReport>) -> serde_json::Result<Value> {
    let mut value = serde_json::to_value(report)?;
    let Some(report) = report else {
        return Ok(value);
    };
    let layers = || report.experts.iter().flat_map(|e| &e.layer_reports);
    let experts_bounced: u64 = layers().map(|l| l.bounced_bytes).sum();
    let direct_io = layers().find_map(|l| l.direct_io).map(|io| io.to_string());
    let Some(map) = value.as_object_mut() else {
        return Ok(value);
    };
    map.insert("direct_io".into(), json!(direct_io));
    let Some(measured) = map.get_mut("measured").and_then(Value::as_array_mut) else {
        return Ok(value);
    };
    for (m, entry) in report.measured.iter().zip(measured.iter_mut()) {
        let Some(entry) = entry.as_object_mut() else {
            continue;
        };
        let bounced = match m.class {
            TensorClass::RoutedExperts => experts_bounced,
            _ => m.bounced_bytes,
        };
        let d = m.direct_reads;
        for (key, n) in [
            ("in_place_bytes", json!(d.in_place_bytes)),
            ("bounced_bytes", json!(bounced)),
            ("uring_reads", json!(d.uring_reads)),
            ("blocking_reads", json!(d.blocking_reads)),
            ("uring_depth", json!(d.uring_depth)),
            ("blocking_depth", json!(d.blocking_depth)),
        ] {
            entry.insert(key.into(), n);
        }
    }
    Ok(value)
}
