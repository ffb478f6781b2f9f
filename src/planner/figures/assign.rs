//! The planner's own assignments of experts to nodes, from the routing statistics: a
//! split by load under the caps the room leaves, and the hybrid (hot experts copied per
//! node or per domain, the cold ones split by load). Each gives a [`Described`] layout
//! for [`Ctx::row`](super::Ctx) to turn into figures.

use super::{Ctx, Described, Place};
use crate::routing::balance;
use crate::store::{HOT, HotCopies, Layout, block};

impl Ctx<'_> {
    /// Per-layer caps (experts per node) so that `base` bytes plus each node's experts
    /// stay within `room` on every node: the even share `ceil(k / n)` of each layer's `k`
    /// experts, plus as many extra experts per layer as the room left allows.
    fn caps(&self, experts: &[usize], room: u64) -> Vec<usize> {
        let n = self.n();
        let layers = &self.model.moe_layers;
        let even: u64 = layers
            .iter()
            .zip(experts)
            .map(|(l, &k)| l.slot_bytes().saturating_mul(k.div_ceil(n) as u64))
            .fold(0, u64::saturating_add);
        let per_extra: u64 = layers
            .iter()
            .zip(experts)
            .filter(|&(_, &k)| k > 0)
            .map(|(l, _)| l.slot_bytes())
            .fold(0, u64::saturating_add);
        let extra = room
            .saturating_sub(even)
            .checked_div(per_extra)
            .unwrap_or(0)
            .min(usize::MAX as u64) as usize;
        experts
            .iter()
            .map(|&k| k.div_ceil(n).saturating_add(extra).min(k))
            .collect()
    }

    pub(super) fn split_by_load(&self) -> Described {
        let n = self.n() as u64;
        let room = self.min_room(self.model.other_bytes.div_ceil(n));
        let experts: Vec<usize> = self.model.moe_layers.iter().map(|l| l.experts).collect();
        let caps = self.caps(&experts, room);
        self.split(
            |l| {
                let i = self.index_of(l.layer);
                match &self.counts[i] {
                    Some(c) => balance(c, &vec![caps[i]; self.n()])
                        .unwrap_or_else(|_| index_homes(l.experts, self.n())),
                    None => index_homes(l.experts, self.n()),
                }
            },
            false,
        )
    }

    /// The least room any node has for experts once `base` bytes are on it.
    fn min_room(&self, base: u64) -> u64 {
        self.budget
            .iter()
            .map(|b| b.saturating_sub(base))
            .min()
            .unwrap_or(0)
    }

    fn index_of(&self, layer: usize) -> usize {
        self.model
            .moe_layers
            .iter()
            .position(|l| l.layer == layer)
            .unwrap_or(0)
    }

    /// Hot experts, hottest first (by probability, ties to the lower expert, then the
    /// lower layer), replicated while the hot bytes plus an even split of the cold ones
    /// fit the least room; an expert that does not fit is skipped and smaller ones after
    /// it are still tried. The cold experts are then split by load (by index where a
    /// layer has no statistics) under the caps the room leaves.
    ///
    /// `per_domain`: the hot experts and the non-expert tensors get one copy per domain,
    /// interleaved over its nodes, so a node holds its domain's share of them; the room
    /// is judged with the smallest domain's share (the largest per node).
    pub(super) fn hybrid(&self, per_domain: bool) -> Described {
        let n = self.n();
        let layers = &self.model.moe_layers;
        // Each node's share of a copy: 1 per node, 1 / its domain's nodes per domain.
        let share: Vec<u64> = (0..n)
            .map(|i| match per_domain {
                true => self
                    .domains
                    .iter()
                    .find(|d| d.contains(&i))
                    .map_or(1, Vec::len) as u64,
                false => 1,
            })
            .collect();
        let widest = share.iter().copied().min().unwrap_or(1).max(1);
        let other: Vec<u64> = share
            .iter()
            .map(|&m| self.model.other_bytes.div_ceil(m))
            .collect();
        let room = (self.budget.iter().zip(&other))
            .map(|(b, o)| b.saturating_sub(*o))
            .min()
            .unwrap_or(0);
        let (hot, hot_bytes) = self.pick_hot(room, widest);
        let caps = self.caps(
            &(hot
                .iter()
                .map(|h| h.iter().filter(|&&x| !x).count())
                .collect::<Vec<_>>()),
            room.saturating_sub(hot_bytes.div_ceil(widest)),
        );
        let hot_place = if per_domain {
            Place::PerDomain
        } else {
            Place::Everywhere
        };
        let places: Vec<Vec<Place>> = layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let cold_ids: Vec<usize> = (0..l.experts).filter(|&e| !hot[i][e]).collect();
                let homes = match &self.counts[i] {
                    Some(c) => {
                        let cc: Vec<u64> = cold_ids.iter().map(|&e| c[e]).collect();
                        balance(&cc, &vec![caps[i]; n])
                            .unwrap_or_else(|_| index_homes(cold_ids.len(), n))
                    }
                    None => index_homes(cold_ids.len(), n),
                };
                let mut places = vec![hot_place; l.experts];
                for (&e, &h) in cold_ids.iter().zip(&homes) {
                    places[e] = Place::Home(h);
                }
                places
            })
            .collect();
        // Bytes and mappings as the store builds it: the first copy in one block per
        // node holding experts (the hot ones in the first node's where its group is that
        // node, else a range of their own), and a region of the hot ones on every other
        // group.
        let homes: Vec<Vec<usize>> = (places.iter())
            .map(|p| p.iter().map(|&place| home_of(place)).collect())
            .collect();
        let shape = if per_domain {
            HotCopies::PerDomain
        } else {
            HotCopies::PerNode
        };
        Described {
            places,
            ..self.arranged(
                other,
                Layout::SplitExperts(self.all_nodes()),
                Some(shape),
                |i| homes.get(i).map(Vec::as_slice),
            )
        }
    }

    /// The hot experts of [`Ctx::hybrid`] (per layer, per expert) and their bytes (one
    /// copy's): hottest first while the hot bytes ÷ `widest` (a node's share of a copy)
    /// plus an even split of the cold ones fit `room`.
    fn pick_hot(&self, room: u64, widest: u64) -> (Vec<Vec<bool>>, u64) {
        let n = self.n();
        let layers = &self.model.moe_layers;
        let mut ranked: Vec<(usize, usize)> = layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| (0..l.experts).map(move |e| (i, e)))
            .collect();
        ranked.sort_by(|&(li, e), &(lj, f)| {
            self.probs[lj][f]
                .total_cmp(&self.probs[li][e])
                .then(e.cmp(&f))
                .then(li.cmp(&lj))
        });
        let mut cold: Vec<usize> = layers.iter().map(|l| l.experts).collect();
        // In u128, exact: a sum saturated at u64::MAX (experts of 2^64 bytes, as a
        // hand-built ModelSizes may say) then less a layer's saving went below zero (a
        // panic in a debug build). Slots are at most 2^64 bytes, layers at most 2^16
        // experts: a sum over layers fits.
        let mut cold_even: u128 = layers
            .iter()
            .zip(&cold)
            .map(|(l, &k)| u128::from(l.slot_bytes()) * k.div_ceil(n) as u128)
            .fold(0, u128::saturating_add);
        let (room, widest) = (u128::from(room), u128::from(widest.max(1)));
        let mut hot_bytes = 0u128;
        let mut hot: Vec<Vec<bool>> = layers.iter().map(|l| vec![false; l.experts]).collect();
        if n > 1 && cold_even <= room {
            for (i, e) in ranked {
                let s = u128::from(layers[i].slot_bytes());
                let k = cold[i];
                let saved = if k.div_ceil(n) > (k - 1).div_ceil(n) {
                    s
                } else {
                    0
                };
                let more = hot_bytes.saturating_add(s);
                let next = more
                    .div_ceil(widest)
                    .saturating_add(cold_even.saturating_sub(saved));
                if next <= room {
                    hot_bytes = more;
                    cold_even = cold_even.saturating_sub(saved);
                    cold[i] -= 1;
                    hot[i][e] = true;
                }
            }
        }
        // At most room × widest (2^64 × 2^10): saturated into u64 as the other figures.
        (hot, u64::try_from(hot_bytes).unwrap_or(u64::MAX))
    }
}

/// An expert's slot position for [`SlotOrder`]: its node's index, or [`HOT`] for a hot
/// one.
fn home_of(place: Place) -> usize {
    match place {
        Place::Home(h) => h,
        _ => HOT,
    }
}

/// Expert `e` of `k` on the `e × n / k`-th node: the store's split by index.
fn index_homes(k: usize, n: usize) -> Vec<usize> {
    (0..n)
        .flat_map(|i| std::iter::repeat_n(i, block(i, n, k).len()))
        .collect()
}
