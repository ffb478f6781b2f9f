//! The local search of [`balance`](super::balance): from the most-loaded node `top`, the
//! single move or swap with another node that gives the pair the lowest larger load,
//! while that is below `top`'s load.
//!
//! Moving `d` worth of count from `top` to node `j` (one expert of count `d`, or a swap
//! whose counts differ by `d`) leaves the pair's larger load at `load[j] + (t + |2d − t|)
//! / 2` with `t = load[top] − load[j]`: the best step with `j` is the `d` nearest `t / 2`,
//! and it improves when `|2d − t| < t`. Each node keeps its experts sorted by count, so the
//! nearest single count is a binary search and the nearest difference of two counts
//! (one on `top`, one on `j`) a merge of the two sorted lists: a step costs
//! O(E + n · |top|), not the O(E²) of trying every pair against every expert.
//!
//! The step taken is the one the exhaustive scan took (kept as the reference in the tests,
//! `reference.rs`): the lowest larger load; among equal ones the lowest node `j`, then the
//! lowest expert moved off `top`, a move before a swap, then the lowest expert moved onto
//! `top`. Each step strictly lowers the sum of squared loads, so the search ends; the step
//! count is bounded as well.

/// Experts of one node as `(count, expert)`, sorted.
type Members = Vec<(u64, usize)>;

/// A step: `e` off `top` to `j`, and `f` from `j` onto `top` if a swap.
struct Step {
    top: usize,
    j: usize,
    e: (u64, usize),
    f: Option<(u64, usize)>,
}

/// Improves `node_of` in place; returns the steps taken.
pub(super) fn improve(counts: &[u64], caps: &[usize], node_of: &mut [usize]) -> usize {
    let n = caps.len();
    let mut members: Vec<Members> = vec![Vec::new(); n];
    let mut load = vec![0u128; n];
    for (e, (&c, &i)) in counts.iter().zip(node_of.iter()).enumerate() {
        if let Some(m) = members.get_mut(i) {
            m.push((c, e));
            load[i] = load[i].saturating_add(u128::from(c));
        }
    }
    members.iter_mut().for_each(|m| m.sort_unstable());
    let limit = counts
        .len()
        .saturating_mul(n)
        .saturating_mul(4)
        .saturating_add(16);
    for steps in 0..limit {
        let Some(step) = best_step(caps, &members, &load) else {
            return steps;
        };
        apply(&step, node_of, &mut members, &mut load);
    }
    limit
}

/// The step of the exhaustive scan, or none that lowers `top`'s load.
fn best_step(caps: &[usize], members: &[Members], load: &[u128]) -> Option<Step> {
    let top = (0..load.len()).max_by_key(|&i| (load[i], std::cmp::Reverse(i)))?;
    let on_top = &members[top];
    // (pair's larger load, j)
    let mut best: Option<(u128, usize)> = None;
    for j in (0..load.len()).filter(|&j| j != top) {
        let t = load[top] - load[j];
        let room = members[j].len() < caps[j];
        let err = [
            room.then(|| nearest_count(on_top, t)).flatten(),
            nearest_difference(on_top, &members[j], t),
        ]
        .into_iter()
        .flatten()
        .min();
        if let Some(err) = err.filter(|&err| err < t) {
            // err < t: (t + err) / 2 < t, no overflow past load[top].
            let m = load[j] + (t + err) / 2;
            if best.is_none_or(|b| m < b.0) {
                best = Some((m, j));
            }
        }
    }
    let (m, j) = best?;
    // The differences that reach m: d in [lo, hi].
    let (lo, hi) = (load[top] - m, m - load[j]);
    let room = members[j].len() < caps[j];
    let mut chosen: Option<Step> = None;
    for &(ce, e) in on_top {
        if chosen.as_ref().is_some_and(|s| s.e.1 < e) {
            continue;
        }
        let ce128 = u128::from(ce);
        let step = if room && (lo..=hi).contains(&ce128) {
            Some(None)
        } else {
            lowest_in(
                &members[j],
                ce128.saturating_sub(hi),
                ce128.saturating_sub(lo),
            )
            .filter(|_| ce128 >= lo)
            .map(Some)
        };
        if let Some(f) = step {
            chosen = Some(Step {
                top,
                j,
                e: (ce, e),
                f,
            });
        }
    }
    chosen
}

/// The least `|2c − t|` over the counts `c` of `sorted`.
fn nearest_count(sorted: &[(u64, usize)], t: u128) -> Option<u128> {
    let p = sorted.partition_point(|&(c, _)| 2 * u128::from(c) < t);
    [p.checked_sub(1), Some(p)]
        .into_iter()
        .flatten()
        .filter_map(|i| sorted.get(i))
        .map(|&(c, _)| (2 * u128::from(c)).abs_diff(t))
        .min()
}

/// The least `|2(a − b) − t|` over `a` of `high` and `b` of `low` with `a > b`: for each
/// `a` (ascending), the `b` nearest `a − t / 2` moves only forward, so one merge.
fn nearest_difference(high: &[(u64, usize)], low: &[(u64, usize)], t: u128) -> Option<u128> {
    let mut best: Option<u128> = None;
    let mut p = 0;
    for &(a, _) in high {
        let a2 = 2 * u128::from(a);
        // Past every b with 2(a − b) > t.
        while p < low.len() && 2 * u128::from(low[p].0) + t < a2 {
            p += 1;
        }
        for &(b, _) in [p.checked_sub(1), Some(p)]
            .into_iter()
            .flatten()
            .filter_map(|i| low.get(i))
        {
            if b < a {
                let err = (2 * u128::from(a - b)).abs_diff(t);
                best = Some(best.map_or(err, |x| x.min(err)));
            }
        }
    }
    best
}

/// The lowest expert of `sorted` whose count is in `[lo, hi]`.
fn lowest_in(sorted: &[(u64, usize)], lo: u128, hi: u128) -> Option<(u64, usize)> {
    let start = sorted.partition_point(|&(c, _)| u128::from(c) < lo);
    let end = sorted.partition_point(|&(c, _)| u128::from(c) <= hi);
    sorted
        .get(start..end.max(start))?
        .iter()
        .min_by_key(|&&(_, e)| e)
        .copied()
}

fn apply(step: &Step, node_of: &mut [usize], members: &mut [Members], load: &mut [u128]) {
    let mut shift = |x: (u64, usize), from: usize, to: usize| {
        if let Ok(p) = members[from].binary_search(&x) {
            members[from].remove(p);
        }
        let p = members[to].binary_search(&x).unwrap_or_else(|p| p);
        members[to].insert(p, x);
        load[from] -= u128::from(x.0);
        load[to] += u128::from(x.0);
        node_of[x.1] = to;
    };
    shift(step.e, step.top, step.j);
    if let Some(f) = step.f {
        shift(f, step.j, step.top);
    }
}
