//! The routing statistics file: one JSON object.
//!
//! ```json
//! {"numapin_routing": 1,
//!  "layers": [{"layer": 3, "counts": [120, 4, 0, 37]},
//!             {"layer": 4, "counts": [9, 9, 80, 2]}]}
//! ```
//! `layer` is the checkpoint's layer index of an MoE layer; `counts[e]` is how many
//! times the router picked expert `e` (integers from 0 to 2^64 - 1). Other keys are
//! ignored; a key given twice in one object is refused. What duplicate, missing and overflowing counts do is in the
//! [module docs](super).

use std::path::Path;

use serde_json::Value;

use super::RoutingStats;
use crate::error::{Error, Result, shown};

const OP: &str = "RoutingStats::from_json";

/// The largest description text read (routing statistics, topology descriptions): 16
/// MiB. The JSON tree costs ~25 times its text (a 100 MB file of counts took 2.5 GB),
/// and real files are far smaller: DeepSeek-V3's 58 × 256 counts take ~300 KB, a
/// 1024-node topology with its distances ~5 MB.
pub(crate) const MAX_TEXT: usize = 16 << 20;

/// The text of a description file, refused past [`MAX_TEXT`] before more is read (a
/// pipe or `/dev/zero` included).
pub(crate) fn read_text(op: &'static str, path: &Path) -> Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_TEXT as u64 + 1).read_to_string(&mut text))
        .map_err(|e| Error::io(op, path.display().to_string(), e))?;
    check_len(op, &text)?;
    Ok(text)
}

/// [`MAX_TEXT`] against `text`.
pub(crate) fn check_len(op: &'static str, text: &str) -> Result<()> {
    if text.len() > MAX_TEXT {
        return Err(Error::too_large(
            op,
            "the description text",
            text.len(),
            MAX_TEXT,
            "16 MiB, the most a routing or topology description may hold",
        ));
    }
    Ok(())
}

impl RoutingStats {
    /// Reads the JSON format above.
    ///
    /// # Errors
    /// Text past 16 MiB; text that is not JSON or gives an object key twice, a missing or wrongly typed key, a version other than 1, a
    /// count that is negative, fractional, not a number or past `u64::MAX`; then as
    /// [`RoutingStats::from_counts`]. Each error names the layer entry and position.
    pub fn from_json(text: &str) -> Result<RoutingStats> {
        check_len(OP, text)?;
        let root: Value = super::strict::from_str(text)
            .map_err(|e| Error::bad_value(OP, "routing statistics", "the text", e.to_string()))?;
        match root.get("numapin_routing") {
            Some(v) if v.as_u64() == Some(1) => {}
            other => {
                return Err(Error::bad_value(
                    OP,
                    "numapin_routing",
                    other.map_or("nothing".to_string(), shown),
                    "the format version must be 1",
                ));
            }
        }
        let Some(entries) = root.get("layers").and_then(Value::as_array) else {
            return Err(Error::bad_value(
                OP,
                "layers",
                root.get("layers").map_or("nothing".into(), shown),
                "an array of {\"layer\": N, \"counts\": [...]} objects",
            ));
        };
        let mut stats = RoutingStats::new();
        for (i, entry) in entries.iter().enumerate() {
            let layer = entry
                .get("layer")
                .and_then(Value::as_u64)
                .and_then(|l| usize::try_from(l).ok())
                .ok_or_else(|| {
                    Error::bad_value(
                        OP,
                        "layer",
                        entry.get("layer").map_or("nothing".into(), shown),
                        format!("layers[{i}].layer must be a layer index"),
                    )
                })?;
            let Some(list) = entry.get("counts").and_then(Value::as_array) else {
                return Err(Error::bad_value(
                    OP,
                    "counts",
                    entry.get("counts").map_or("nothing".into(), shown),
                    format!("layers[{i}] (layer {layer}).counts must be an array"),
                ));
            };
            let mut counts = Vec::with_capacity(list.len());
            for (e, v) in list.iter().enumerate() {
                counts.push(v.as_u64().ok_or_else(|| {
                    Error::bad_value(
                        OP,
                        "count",
                        shown(v),
                        format!(
                            "layers[{i}] (layer {layer}) expert {e}: a count is an integer \
                             from 0 to {}",
                            u64::MAX
                        ),
                    )
                })?);
            }
            stats.add_layer(layer, &counts)?;
        }
        Ok(stats)
    }

    /// Reads a file in the JSON format of [`RoutingStats::from_json`].
    ///
    /// # Errors
    /// The file cannot be read, or as [`RoutingStats::from_json`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<RoutingStats> {
        let text = read_text("RoutingStats::from_file", path.as_ref())?;
        RoutingStats::from_json(&text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_format_and_refuses_bad_counts() {
        let s = RoutingStats::from_json(
            r#"{"numapin_routing":1,"layers":[{"layer":3,"counts":[1,2]},
                {"layer":3,"counts":[4,0]},{"layer":5,"counts":[0,7]}]}"#,
        )
        .unwrap();
        assert_eq!(s.layer(3), Some(&[5, 2][..]));
        assert_eq!(s.layer(5), Some(&[0, 7][..]));
        for (bad, says) in [
            (
                r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[1,-2]}]}"#,
                "expert 1",
            ),
            (
                r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[1.5]}]}"#,
                "expert 0",
            ),
            (
                r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":["7"]}]}"#,
                "expert 0",
            ),
            (
                r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[18446744073709551616]}]}"#,
                "expert 0",
            ),
            (
                r#"{"numapin_routing":1,"layers":[{"layer":-1,"counts":[1]}]}"#,
                "layers[0].layer",
            ),
            (
                r#"{"numapin_routing":1,"layers":[{"layer":1}]}"#,
                "counts must be",
            ),
            (r#"{"numapin_routing":2,"layers":[]}"#, "version"),
            (r#"{"layers":[]}"#, "version"),
            (r#"{"numapin_routing":1}"#, "an array"),
            ("not json", "line 1"),
            (
                r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[18446744073709551615]},
                   {"layer":1,"counts":[1]}]}"#,
                "layer 1 expert 0",
            ),
        ] {
            let e = RoutingStats::from_json(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
