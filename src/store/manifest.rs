//! The manifest of an exported store: which region is which, in a versioned text form
//! with a strict grammar, so that a worker never guesses at what it attaches.
//!
//! ```text
//! numapin-store 2
//! region layer=0 kind=weights len=2097152 stride=1052672 slot_bytes=1048576 slots=2 loaded=1048576,-
//! ```
//!
//! One header line, then one `region` line per region in [`super::Export::files`] order.
//! Fields come in this order, separated by one ASCII space; numbers are ASCII decimal
//! without sign or leading zeros; `loaded` lists each slot's loaded bytes, `-` for a
//! released slot, comma-separated (empty when `slots=0`). A `(layer, kind)` pair appears
//! once. Every line ends with `\n`.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::Kind;
use super::table;
use crate::error::{Error, Result};

/// One exported region: which layer and tensor, its length, stride, slot size, and the
/// bytes loaded in each slot (`None`: released).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ManifestRegion {
    /// The layer.
    pub layer: usize,
    /// Weights or scales.
    pub kind: Kind,
    /// Bytes of the region (and at most of its file).
    pub len: usize,
    /// Distance between slots.
    pub stride: usize,
    /// The most bytes a slot holds.
    pub slot_bytes: usize,
    /// Loaded bytes per slot.
    pub loaded: Vec<Option<usize>>,
}

/// The layout of an exported store, in the order of [`super::Export::files`].
///
/// # Example
/// ```
/// use numapin::store::{Kind, Manifest, ManifestRegion};
/// let manifest = Manifest {
///     regions: vec![ManifestRegion {
///         layer: 3,
///         kind: Kind::Weights,
///         len: 8192,
///         stride: 4096,
///         slot_bytes: 4000,
///         loaded: vec![Some(4000), None],
///     }],
/// };
/// assert_eq!(Manifest::parse(&manifest.to_text())?, manifest);
/// assert!(Manifest::parse("numapin-store 2\nregion layer=+3 kind=weights\n").is_err());
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Manifest {
    /// The regions.
    pub regions: Vec<ManifestRegion>,
}

/// The header line: the format's name and version.
pub(crate) const MANIFEST_HEADER: &str = "numapin-store 2";

const OP: &str = "Manifest::parse";

impl Manifest {
    /// The text form, for a file or a pipe to the workers. [`Manifest::parse`] reads it
    /// back equal.
    pub fn to_text(&self) -> String {
        let mut out = format!("{MANIFEST_HEADER}\n");
        for r in &self.regions {
            let loaded: Vec<String> = r
                .loaded
                .iter()
                .map(|l| l.map_or("-".to_string(), |n| n.to_string()))
                .collect();
            let _ = writeln!(
                out,
                "region layer={} kind={} len={} stride={} slot_bytes={} slots={} loaded={}",
                r.layer,
                r.kind.name(),
                r.len,
                r.stride,
                r.slot_bytes,
                r.loaded.len(),
                loaded.join(",")
            );
        }
        out
    }

    /// Parses [`Manifest::to_text`], strictly: anything `to_text` would not write is an
    /// error that quotes the line and says what is wrong. The figures must also be
    /// consistent: slots fit the region (`stride × slots ≤ len`), a slot fits its stride,
    /// a loaded length fits its slot, and the layer is one a store can hold.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong header or version, a line that is not a
    /// `region` line with exactly the fields above, a number with a sign, a leading zero
    /// or non-ASCII digits, a `loaded` list whose length is not `slots`, a region that
    /// appears twice, or figures that do not fit.
    pub fn parse(text: &str) -> Result<Manifest> {
        let Some(body) = text.strip_suffix('\n') else {
            return Err(bad(0, text, "the manifest does not end with a newline"));
        };
        let mut lines = body.split('\n');
        let header = lines.next().unwrap_or("");
        if header != MANIFEST_HEADER {
            let why = if header.starts_with("numapin-store ") {
                format!("unsupported manifest version (this crate reads {MANIFEST_HEADER:?})")
            } else {
                format!("not a numapin store manifest (expected {MANIFEST_HEADER:?})")
            };
            return Err(bad(1, header, &why));
        }
        let mut seen = BTreeSet::new();
        let mut regions = Vec::new();
        for (i, line) in lines.enumerate() {
            let number = i + 2;
            let region = parse_region(line).map_err(|why| bad(number, line, &why))?;
            if !seen.insert((region.layer, region.kind)) {
                return Err(bad(
                    number,
                    line,
                    &format!(
                        "layer {} {} appears twice",
                        region.layer,
                        region.kind.name()
                    ),
                ));
            }
            regions.push(region);
        }
        Ok(Manifest { regions })
    }
}

fn bad(line_number: usize, line: &str, why: &str) -> Error {
    // Both clipped: `why` may quote a word of the line, and a line may be megabytes.
    let clip = |text: &str, max: usize| match crate::error::clip(text, max) {
        (text, false) => text.to_owned(),
        (head, true) => format!("{head}… ({} bytes)", text.len()),
    };
    let (why, quoted) = (clip(why, 400), clip(line, 200));
    Error::invalid(OP, format!("line {line_number}: {why}: {quoted:?}"))
}

fn parse_region(line: &str) -> std::result::Result<ManifestRegion, String> {
    const KEYS: [&str; 7] = [
        "layer",
        "kind",
        "len",
        "stride",
        "slot_bytes",
        "slots",
        "loaded",
    ];
    let mut words = line.split(' ');
    if words.next() != Some("region") {
        return Err("expected a line starting with \"region \"".into());
    }
    let mut values = [""; KEYS.len()];
    for (key, value) in KEYS.iter().zip(values.iter_mut()) {
        let word = words
            .next()
            .ok_or_else(|| format!("missing field {key}="))?;
        *value = word
            .strip_prefix(key)
            .and_then(|w| w.strip_prefix('='))
            .ok_or_else(|| format!("expected field {key}= here, found {word:?}"))?;
    }
    if let Some(extra) = words.next() {
        return Err(format!("unexpected text after loaded=: {extra:?}"));
    }
    let [layer, kind, len, stride, slot_bytes, slots, loaded] = values;
    let layer = number("layer", layer)?;
    if layer >= table::MAX_INDEX {
        return Err(format!(
            "layer {layer} is beyond the {} layers a store holds",
            table::MAX_INDEX
        ));
    }
    let kind = match kind {
        "weights" => Kind::Weights,
        "scales" => Kind::Scales,
        other => return Err(format!("kind is weights or scales, not {other:?}")),
    };
    let (len, stride, slot_bytes, slots) = (
        number("len", len)?,
        number("stride", stride)?,
        number("slot_bytes", slot_bytes)?,
        number("slots", slots)?,
    );
    let loaded: Vec<Option<usize>> = if loaded.is_empty() {
        Vec::new()
    } else {
        loaded
            .split(',')
            .map(|v| match v {
                "-" => Ok(None),
                v => number("loaded", v).map(Some),
            })
            .collect::<std::result::Result<_, _>>()?
    };
    if loaded.len() != slots {
        return Err(format!(
            "slots={slots} but loaded= lists {} slots",
            loaded.len()
        ));
    }
    if stride.checked_mul(slots).is_none_or(|n| n > len) {
        return Err(format!(
            "{slots} slots of stride {stride} do not fit in len {len}"
        ));
    }
    if slot_bytes > stride {
        return Err(format!(
            "slot_bytes {slot_bytes} is larger than the stride {stride}"
        ));
    }
    if let Some(n) = loaded.iter().flatten().find(|&&n| n > slot_bytes) {
        return Err(format!(
            "a slot has {n} bytes loaded, more than slot_bytes {slot_bytes}"
        ));
    }
    Ok(ManifestRegion {
        layer,
        kind,
        len,
        stride,
        slot_bytes,
        loaded,
    })
}

/// ASCII decimal digits only, no sign, no leading zero (but `0` itself), fitting usize.
fn number(key: &str, text: &str) -> std::result::Result<usize, String> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if !canonical {
        return Err(format!(
            "{key}: {text:?} is not a decimal number without sign or leading zeros"
        ));
    }
    text.parse()
        .map_err(|_| format!("{key}: {text} does not fit in {} bits", usize::BITS))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn text(lines: &[&str]) -> String {
        let mut out = format!("{MANIFEST_HEADER}\n");
        for l in lines {
            out.push_str(l);
            out.push('\n');
        }
        out
    }

    const GOOD: &str =
        "region layer=1 kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-";

    #[test]
    fn garbage_is_refused_with_the_line_and_the_reason() {
        assert!(Manifest::parse(&text(&[GOOD])).is_ok());
        let cases: &[(&str, &str)] = &[
            // The first word is not ignored.
            (
                "zregion layer=1 kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "starting with \"region",
            ),
            // Signs, leading zeros, non-ASCII spaces and digits.
            (
                "region layer=1 kind=weights len=+8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "without sign",
            ),
            (
                "region layer=01 kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "leading zeros",
            ),
            (
                "region\u{a0}layer=1 kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "starting with",
            ),
            (
                "region layer=1 kind=weights  len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "expected field len=",
            ),
            (
                "region layer=١ kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "without sign",
            ),
            // Fields out of order, missing, extra.
            (
                "region kind=weights layer=1 len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "expected field layer=",
            ),
            (
                "region layer=1 kind=weights len=8192",
                "missing field stride=",
            ),
            (
                "region layer=1 kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,- x",
                "unexpected text",
            ),
            (
                "region layer=1 kind=both len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "weights or scales",
            ),
            // Figures that do not fit.
            (
                "region layer=1 kind=weights len=8192 stride=4096 slot_bytes=100 slots=3 loaded=100,-,-",
                "do not fit",
            ),
            (
                "region layer=1 kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100",
                "lists 1 slots",
            ),
            (
                "region layer=1 kind=weights len=8192 stride=4096 slot_bytes=5000 slots=2 loaded=100,-",
                "larger than the stride",
            ),
            (
                "region layer=1 kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=101,-",
                "more than slot_bytes",
            ),
            (
                "region layer=1048575 kind=weights len=8192 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "beyond the",
            ),
            (
                "region layer=1 kind=weights len=99999999999999999999999 stride=4096 slot_bytes=100 slots=2 loaded=100,-",
                "does not fit in",
            ),
            ("", "starting with"),
        ];
        for (line, needle) in cases {
            let err = Manifest::parse(&text(&[line])).unwrap_err().to_string();
            assert!(err.contains(needle), "{line:?}: {needle:?} not in {err}");
            assert!(err.contains("line 2"), "{err}");
        }
        let twice = Manifest::parse(&text(&[GOOD, GOOD]))
            .unwrap_err()
            .to_string();
        assert!(
            twice.contains("line 3") && twice.contains("appears twice"),
            "{twice}"
        );
        for (input, needle) in [
            ("numapin-store 1\n", "unsupported manifest version"),
            ("numapin-store 2", "newline"),
            ("numapin-stor 2\n", "not a numapin store manifest"),
            ("", "newline"),
        ] {
            let err = Manifest::parse(input).unwrap_err().to_string();
            assert!(err.contains(needle), "{input:?}: {err}");
        }
    }

    #[test]
    fn a_zero_slot_region_round_trips() {
        let m = Manifest {
            regions: vec![ManifestRegion {
                layer: 0,
                kind: Kind::Scales,
                len: 0,
                stride: 0,
                slot_bytes: 0,
                loaded: vec![],
            }],
        };
        assert_eq!(Manifest::parse(&m.to_text()).unwrap(), m);
        assert_eq!(
            Manifest::parse(&Manifest::default().to_text()).unwrap(),
            Manifest::default()
        );
    }

    fn region() -> impl Strategy<Value = ManifestRegion> {
        (
            0..table::MAX_INDEX,
            any::<bool>(),
            0usize..1 << 40,
            0usize..64,
            proptest::collection::vec(proptest::option::of(any::<usize>()), 0..64),
        )
            .prop_map(|(layer, scales, stride, spare, loaded)| {
                let slot_bytes = stride.saturating_sub(spare);
                let loaded: Vec<Option<usize>> = loaded
                    .into_iter()
                    .map(|l| l.map(|n| n % (slot_bytes + 1)))
                    .collect();
                ManifestRegion {
                    layer,
                    kind: if scales { Kind::Scales } else { Kind::Weights },
                    len: stride * loaded.len() + spare,
                    stride,
                    slot_bytes,
                    loaded,
                }
            })
    }

    proptest! {
        #[test]
        fn every_written_manifest_parses_back_equal(
            regions in proptest::collection::vec(region(), 0..8)
        ) {
            let mut seen = BTreeSet::new();
            let regions: Vec<ManifestRegion> =
                regions.into_iter().filter(|r| seen.insert((r.layer, r.kind))).collect();
            let m = Manifest { regions };
            prop_assert_eq!(Manifest::parse(&m.to_text()).unwrap(), m);
        }

        #[test]
        fn parse_never_panics(input in "(numapin-store 2\n)?[ -~\u{a0}\n]{0,200}") {
            let _ = Manifest::parse(&input);
        }
    }
}
