//! Which experts of each layer a rank holds ([`ExpertShare`]): all, ranges of global ids,
//! the `k`-th of `n` equal parts, or a function of the layer; resolved per layer to ids.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};

const OP: &str = "ExpertShare";

/// The experts of each layer a rank holds: all of them, ranges of ids, the `k`-th of `n`
/// equal contiguous parts, or a function of the layer (EPLB-style placements differ per
/// layer). Ids are global: expert 70 is expert 70 of the checkpoint's layer in every
/// rank.
///
/// # Example
/// ```
/// use numapin::model::ExpertShare;
/// let share = ExpertShare::parse("0-63,96")?;
/// assert_eq!(share.resolve(3, 128)?.len(), 65);
/// assert_eq!(ExpertShare::part(1, 4)?.resolve(3, 128)?, (32..64).collect::<Vec<_>>());
/// // Per layer: layer 1 holds 0-3, the others 4-7.
/// let eplb = ExpertShare::per_layer(|layer, _experts| {
///     ExpertShare::range(if layer == 1 { 0..4 } else { 4..8 })
/// });
/// assert_eq!(eplb.resolve(2, 8)?, vec![4, 5, 6, 7]);
/// assert!(ExpertShare::parse("0-9,5-12").is_err()); // overlapping ranges
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Clone)]
pub struct ExpertShare(Spec);

type PerLayer = dyn Fn(usize, usize) -> Result<ExpertShare> + Send + Sync;

#[derive(Clone)]
enum Spec {
    All,
    /// Sorted, non-empty, non-overlapping.
    Ranges(Vec<Range<usize>>),
    Part {
        k: usize,
        n: usize,
    },
    PerLayer(Arc<PerLayer>),
}

impl Default for ExpertShare {
    fn default() -> Self {
        ExpertShare::all()
    }
}

impl fmt::Debug for ExpertShare {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ExpertShare({self})")
    }
}

impl fmt::Display for ExpertShare {
    /// `all`, `0-63,96` (inclusive ranges, as the CLI takes them), `1/4`, `per-layer`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Spec::All => f.write_str("all"),
            Spec::Ranges(ranges) => {
                let text: Vec<String> = ranges
                    .iter()
                    .map(|r| match r.end - r.start {
                        1 => r.start.to_string(),
                        _ => format!("{}-{}", r.start, r.end - 1),
                    })
                    .collect();
                f.write_str(&text.join(","))
            }
            Spec::Part { k, n } => write!(f, "{k}/{n}"),
            Spec::PerLayer(_) => f.write_str("per-layer"),
        }
    }
}

impl ExpertShare {
    /// Every expert of every layer (no share: the whole checkpoint).
    pub fn all() -> ExpertShare {
        ExpertShare(Spec::All)
    }

    /// Whether this is [`ExpertShare::all`].
    pub(crate) fn is_all(&self) -> bool {
        matches!(self.0, Spec::All)
    }

    /// The experts `range` (end exclusive) of every layer.
    ///
    /// # Errors
    /// An empty range.
    pub fn range(range: Range<usize>) -> Result<ExpertShare> {
        ExpertShare::ranges([range])
    }

    /// The experts of several ranges (ends exclusive), in any order.
    ///
    /// # Errors
    /// No range, an empty range, or two ranges that overlap (each expert once: the error
    /// names both).
    pub fn ranges(ranges: impl IntoIterator<Item = Range<usize>>) -> Result<ExpertShare> {
        let mut ranges: Vec<Range<usize>> = ranges.into_iter().collect();
        if ranges.is_empty() {
            return Err(Error::empty(OP, "expert ranges (a share holds experts)"));
        }
        if let Some((i, r)) = ranges.iter().enumerate().find(|(_, r)| r.is_empty()) {
            return Err(Error::empty(
                OP,
                format!("expert range {i} ({}..{})", r.start, r.end),
            ));
        }
        ranges.sort_by_key(|r| (r.start, r.end));
        if let Some(w) = ranges.windows(2).find(|w| w[0].end > w[1].start) {
            return Err(Error::bad_value(
                OP,
                "expert share",
                format!(
                    "{}-{} and {}-{}",
                    w[0].start,
                    w[0].end - 1,
                    w[1].start,
                    w[1].end - 1
                ),
                "overlapping ranges in one share (each expert at most once)",
            ));
        }
        Ok(ExpertShare(Spec::Ranges(ranges)))
    }

    /// The experts `ids` of every layer, in any order.
    ///
    /// # Errors
    /// No id, an id given twice (named), or `usize::MAX`.
    pub fn list(ids: impl IntoIterator<Item = usize>) -> Result<ExpertShare> {
        let mut ids: Vec<usize> = ids.into_iter().collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::bad_value(
                OP,
                "expert share",
                format!("expert {} twice", w[0]),
                "a share lists each expert at most once",
            ));
        }
        let mut ranges = Vec::with_capacity(ids.len());
        for id in ids {
            let end = id
                .checked_add(1)
                .ok_or_else(|| Error::overflow(OP, format!("expert id {id} + 1")))?;
            ranges.push(id..end);
        }
        ExpertShare::ranges(ranges)
    }

    /// The `k`-th of `n` equal contiguous parts of each layer's experts (rank `k` of `n`
    /// under expert parallelism): experts `⌈k·E/n⌉..⌈(k+1)·E/n⌉` of a layer of `E`, the
    /// same blocks [`Layout::SplitExperts`](crate::store::Layout::SplitExperts) makes.
    ///
    /// # Errors
    /// `n` is 0 or `k ≥ n`.
    pub fn part(k: usize, n: usize) -> Result<ExpertShare> {
        if n == 0 || k >= n {
            return Err(Error::bad_value(
                OP,
                "expert share part",
                format!("{k}/{n}"),
                "k/n takes the k-th of n parts: n > 0 and k < n",
            ));
        }
        Ok(ExpertShare(Spec::Part { k, n }))
    }

    /// A share that differs per layer: `f(layer, experts_in_layer)` says which (an
    /// EPLB placement). It is asked once per layer when the share is applied.
    pub fn per_layer(
        f: impl Fn(usize, usize) -> Result<ExpertShare> + Send + Sync + 'static,
    ) -> ExpertShare {
        ExpertShare(Spec::PerLayer(Arc::new(f)))
    }

    /// Parses the CLI syntax: `all`; `k/n` ([`ExpertShare::part`]); a comma list of ids
    /// and inclusive ranges, `0-63,96,100-127` ([`ExpertShare::ranges`]).
    ///
    /// # Errors
    /// [`Error::Parse`] naming the piece that is not a number or a range (a reversed
    /// range `9-3` included); the constructors' errors.
    pub fn parse(text: &str) -> Result<ExpertShare> {
        let text = text.trim();
        if text == "all" {
            return Ok(ExpertShare::all());
        }
        let parse_error = |part: &str, reason: &str| Error::Parse {
            what: "expert share",
            input: crate::error::clip_owned(text.to_owned(), 200),
            part: crate::error::clip_owned(part.to_owned(), 64),
            reason: reason.to_owned(),
        };
        // Whitespace around a piece is allowed; a sign is not (`+1` is no expert id).
        let number = |part: &str| -> Result<usize> {
            crate::error::decimal(part.trim())
                .ok_or_else(|| parse_error(part, "not an expert number"))
        };
        if let Some((k, n)) = text.split_once('/') {
            return ExpertShare::part(number(k)?, number(n)?);
        }
        let mut ranges = Vec::new();
        for part in text.split(',') {
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (number(a)?, number(b)?),
                None => (number(part)?, number(part)?),
            };
            if a > b {
                return Err(parse_error(part, "a reversed range (first > last)"));
            }
            let end = b
                .checked_add(1)
                .ok_or_else(|| parse_error(part, "past the largest expert id"))?;
            ranges.push(a..end);
        }
        ExpertShare::ranges(ranges)
    }

    /// The global ids this share holds of `layer`, which has `experts` experts:
    /// increasing, none repeated.
    ///
    /// # Errors
    /// More experts than [`MAX_EXPERTS_PER_LAYER`](crate::model::MAX_EXPERTS_PER_LAYER)
    /// ([`crate::Invalid::TooLarge`]), an id past the layer's count ([`Error::OutOfRange`]
    /// naming the id and the layer),
    /// nothing held in this layer ([`crate::Invalid::Empty`]: `k/n` with `n` greater
    /// than the experts, a per-layer function's empty answer), a per-layer function's
    /// own error, or a per-layer function that answers another per-layer share.
    pub fn resolve(&self, layer: usize, experts: usize) -> Result<Vec<usize>> {
        // Every id is listed: a count no checkpoint can hold is refused before a list of
        // it is made (the planner's ceiling, as for a checkpoint's own layers).
        if experts > crate::model::MAX_EXPERTS_PER_LAYER {
            return Err(Error::too_large(
                OP,
                format!("layer {layer}'s {experts} experts"),
                experts,
                crate::model::MAX_EXPERTS_PER_LAYER,
                "MAX_EXPERTS_PER_LAYER",
            ));
        }
        let ids: Vec<usize> = match &self.0 {
            Spec::All => (0..experts).collect(),
            Spec::Ranges(ranges) => {
                if let Some(r) = ranges.iter().find(|r| r.end > experts) {
                    return Err(Error::OutOfRange {
                        op: OP,
                        // A share of many ranges prints as many (65,536 single experts: 400 KB).
                        what: format!(
                            "expert of layer {layer} in the share {}",
                            crate::error::shown(self)
                        ),
                        index: r.end.max(experts + 1) - 1,
                        len: experts,
                    });
                }
                ranges.iter().flat_map(Clone::clone).collect()
            }
            Spec::Part { k, n } => part(*k, *n, experts).collect(),
            Spec::PerLayer(f) => {
                let share = f(layer, experts)?;
                if let Spec::PerLayer(_) = share.0 {
                    return Err(Error::bad_value(
                        OP,
                        "the per-layer function's share",
                        format!("for layer {layer}"),
                        "a per-layer share again: it must answer a share of the layer",
                    ));
                }
                return share.resolve(layer, experts);
            }
        };
        if ids.is_empty() {
            return Err(Error::empty(
                OP,
                format!(
                    "experts of layer {layer} (of {experts}) in the share {}",
                    crate::error::shown(self)
                ),
            ));
        }
        Ok(ids)
    }
}

/// Experts `⌈k·E/n⌉..⌈(k+1)·E/n⌉` of `experts` (the store's split blocks).
fn part(k: usize, n: usize, experts: usize) -> Range<usize> {
    let start = |i: usize| (i as u128 * experts as u128).div_ceil(n.max(1) as u128) as usize;
    start(k)..start(k + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Invalid;

    #[test]
    fn parse_and_resolve_agree_with_the_ids_meant() {
        let ids = |s: &str, experts| ExpertShare::parse(s).unwrap().resolve(0, experts).unwrap();
        assert_eq!(ids("0-3,7", 8), vec![0, 1, 2, 3, 7]);
        assert_eq!(ids("7,0-1", 8), vec![0, 1, 7]);
        assert_eq!(ids("all", 3), vec![0, 1, 2]);
        assert_eq!(ids("0/2", 5), vec![0, 1, 2]);
        assert_eq!(ids("1/2", 5), vec![3, 4]);
        // Every part of every split covers the layer once.
        for n in 1..=9 {
            for experts in n..=20 {
                let all: Vec<usize> = (0..n).flat_map(|k| part(k, n, experts)).collect();
                assert_eq!(all, (0..experts).collect::<Vec<_>>(), "{n} {experts}");
            }
        }
        assert_eq!(
            ExpertShare::parse("0-63,96").unwrap().to_string(),
            "0-63,96"
        );
    }

    #[test]
    fn bad_shares_name_what_and_where() {
        let err = ExpertShare::parse("0-9,5-12").unwrap_err().to_string();
        assert!(
            err.contains("0-9 and 5-12") && err.contains("overlapping"),
            "{err}"
        );
        let err = ExpertShare::list([3, 1, 3]).unwrap_err().to_string();
        assert!(err.contains("expert 3 twice"), "{err}");
        match ExpertShare::parse("0-9").unwrap().resolve(4, 8) {
            Err(Error::OutOfRange {
                index: 9,
                len: 8,
                what,
                ..
            }) => {
                assert!(what.contains("layer 4"), "{what}")
            }
            other => panic!("{other:?}"),
        }
        match ExpertShare::part(3, 4).unwrap().resolve(2, 2) {
            Err(Error::InvalidArgument {
                reason: Invalid::Empty { what },
                ..
            }) => {
                assert!(what.contains("layer 2"), "{what}")
            }
            other => panic!("{other:?}"),
        }
        assert!(ExpertShare::ranges([]).is_err());
        assert!(ExpertShare::range(3..3).is_err());
        assert!(ExpertShare::part(2, 2).is_err());
        assert!(ExpertShare::part(0, 0).is_err());
        for bad in [
            "",
            "x",
            "9-3",
            "1-",
            "-1",
            "1/0",
            "a/2",
            "18446744073709551615",
        ] {
            assert!(ExpertShare::parse(bad).is_err(), "{bad:?}");
        }
        let nested = ExpertShare::per_layer(|_, _| {
            Ok(ExpertShare::per_layer(|_, _| Ok(ExpertShare::all())))
        });
        assert!(nested.resolve(0, 4).is_err());
        let failing = ExpertShare::per_layer(|layer, _| {
            Err(Error::empty("test", format!("placement for layer {layer}")))
        });
        assert!(
            failing
                .resolve(5, 4)
                .unwrap_err()
                .to_string()
                .contains("layer 5")
        );
    }
}
