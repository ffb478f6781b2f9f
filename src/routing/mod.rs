//! Routing statistics and load-balanced expert assignment.
//!
//! [`RoutingStats`] holds how often the router picked each expert of each MoE layer
//! (counts per `(layer, expert)`, from a trace): through [`RoutingStats::from_counts`],
//! or from the JSON format read by [`RoutingStats::from_json`] (described there and in
//! `docs/planner.md`). [`balance`] assigns the experts of one layer to nodes so that the
//! sum of counts per node is as even as it can make it, under a per-node cap.
//!
//! What odd input does, in one place:
//! - a layer given twice (two entries, or two calls): its counts are **summed** expert by
//!   expert (two traces concatenated add up); the two must have the same expert count;
//! - a sum (or a JSON number) past `u64::MAX`: an error ([`Invalid::Overflow`] or
//!   [`Invalid::BadValue`]), never a wrap or a saturation;
//! - a MoE layer of the checkpoint with no entry: no statistics for that layer, which is
//!   then placed as without statistics (split by index, nothing hot); a layer whose counts
//!   are all zero is treated the same way;
//! - a layer the checkpoint does not have, or a count list whose length is not the
//!   layer's expert count: an error from [`RoutingStats::check_against`];
//! - negative, fractional or non-numeric counts: an error naming the layer and position.
//!
//! [`Invalid::Overflow`]: crate::error::Invalid::Overflow
//! [`Invalid::BadValue`]: crate::error::Invalid::BadValue

mod balance;
#[cfg(feature = "model")]
mod json;
#[cfg(feature = "model")]
pub(crate) mod strict;

use std::collections::BTreeMap;

use crate::error::{Error, Result};

pub use balance::{balance, node_loads};
#[cfg(feature = "model")]
pub(crate) use json::{check_len, read_text};

const OP: &str = "RoutingStats";

/// Counts per `(layer, expert)`: how many times the router sent a token to each expert.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutingStats {
    layers: BTreeMap<usize, Vec<u64>>,
}

impl RoutingStats {
    /// No statistics.
    pub fn new() -> RoutingStats {
        RoutingStats::default()
    }

    /// Statistics from `(layer, counts)` pairs, `counts[e]` being expert `e`'s count. A
    /// layer given twice has its counts summed (see the [module docs](self)).
    ///
    /// # Errors
    /// An empty count list, a repeated layer with another expert count, or a sum past
    /// `u64::MAX`.
    pub fn from_counts<C: AsRef<[u64]>>(
        layers: impl IntoIterator<Item = (usize, C)>,
    ) -> Result<RoutingStats> {
        let mut stats = RoutingStats::new();
        for (layer, counts) in layers {
            stats.add_layer(layer, counts.as_ref())?;
        }
        Ok(stats)
    }

    /// Adds the counts of one layer (summed with what the layer has already).
    ///
    /// # Errors
    /// As [`RoutingStats::from_counts`].
    pub(crate) fn add_layer(&mut self, layer: usize, counts: &[u64]) -> Result<()> {
        if counts.is_empty() {
            return Err(Error::empty(OP, format!("counts of layer {layer}")));
        }
        let Some(have) = self.layers.get_mut(&layer) else {
            self.layers.insert(layer, counts.to_vec());
            return Ok(());
        };
        if have.len() != counts.len() {
            return Err(Error::mismatch(
                OP,
                format!("experts counted in the two entries of layer {layer}"),
                have.len(),
                counts.len(),
            ));
        }
        let mut sum = have.clone();
        for (e, (s, &c)) in sum.iter_mut().zip(counts).enumerate() {
            *s = s.checked_add(c).ok_or_else(|| {
                Error::overflow(OP, format!("layer {layer} expert {e}: {s} + {c}"))
            })?;
        }
        *have = sum;
        Ok(())
    }

    /// The counts of `layer` (`None`: no statistics for it, or all its counts are zero —
    /// both mean "place as without statistics").
    pub fn layer(&self, layer: usize) -> Option<&[u64]> {
        self.layers
            .get(&layer)
            .filter(|c| c.iter().any(|&n| n > 0))
            .map(Vec::as_slice)
    }

    /// Every layer with its counts, in layer order (zero layers included).
    pub fn layers(&self) -> impl Iterator<Item = (usize, &[u64])> {
        self.layers.iter().map(|(&l, c)| (l, c.as_slice()))
    }

    /// Whether there are no statistics at all.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Checks the statistics against a model's MoE layers, `(layer, experts)` each.
    ///
    /// # Errors
    /// A layer of the statistics that the model does not have, or whose expert count
    /// disagrees with the model's ([`Invalid::Mismatch`](crate::error::Invalid::Mismatch)).
    pub fn check_against(&self, model: &[(usize, usize)]) -> Result<()> {
        for (&layer, counts) in &self.layers {
            match model.iter().find(|(l, _)| *l == layer) {
                None => {
                    let have: Vec<String> = model.iter().map(|(l, _)| l.to_string()).collect();
                    return Err(Error::bad_value(
                        OP,
                        "layer",
                        layer,
                        format!(
                            "the checkpoint has no MoE layer {layer} (its MoE layers: {})",
                            have.join(",")
                        ),
                    ));
                }
                Some(&(_, experts)) if experts != counts.len() => {
                    return Err(Error::mismatch(
                        OP,
                        format!("experts of layer {layer}: the checkpoint's against the counts"),
                        experts,
                        counts.len(),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Invalid;

    fn reason(e: Error) -> Invalid {
        match e {
            Error::InvalidArgument { reason, .. } => reason,
            other => panic!("not an invalid argument: {other:?}"),
        }
    }

    #[test]
    fn duplicates_sum_zero_layers_count_as_missing() {
        let s = RoutingStats::from_counts([(3, vec![1, 2]), (4, vec![0, 0]), (3, vec![10, 0])])
            .unwrap();
        assert_eq!(s.layer(3), Some(&[11, 2][..]));
        assert_eq!(s.layer(4), None, "all-zero layer: no statistics");
        assert_eq!(s.layer(5), None);
        assert_eq!(s.layers().count(), 2);
    }

    #[test]
    fn bad_counts_are_named_errors() {
        let r = RoutingStats::from_counts([(1, vec![u64::MAX, 1]), (1, vec![1, 0])]);
        assert!(
            matches!(reason(r.unwrap_err()), Invalid::Overflow { what } if what.contains("layer 1 expert 0"))
        );
        let r = RoutingStats::from_counts([(1, vec![1, 1]), (1, vec![1])]);
        assert!(matches!(
            reason(r.unwrap_err()),
            Invalid::Mismatch {
                expected: 2,
                found: 1,
                ..
            }
        ));
        let r = RoutingStats::from_counts([(1, Vec::<u64>::new())]);
        assert!(matches!(reason(r.unwrap_err()), Invalid::Empty { .. }));
        let s = RoutingStats::from_counts([(2, vec![1, 2, 3])]).unwrap();
        assert!(s.check_against(&[(2, 3)]).is_ok());
        assert!(matches!(
            reason(s.check_against(&[(2, 4)]).unwrap_err()),
            Invalid::Mismatch {
                expected: 4,
                found: 3,
                ..
            }
        ));
        assert!(matches!(
            reason(s.check_against(&[(1, 3)]).unwrap_err()),
            Invalid::BadValue { what: "layer", .. }
        ));
    }
}
