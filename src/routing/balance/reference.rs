//! The exhaustive search [`balance`](super::balance) ran before issue 31 (a scan of every
//! expert pair against every expert per step: O(E²) a step), kept verbatim as the
//! reference: the indexed search must take the very same steps, so it returns the same
//! assignment on every input, and is therefore exactly as balanced.

use proptest::prelude::*;

/// The old `balance` after its argument checks: LPT by a scan of the nodes, then the old
/// local search.
fn old_balance(counts: &[u64], caps: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..counts.len()).collect();
    order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
    let mut node_of = vec![0usize; counts.len()];
    let mut load = vec![0u128; caps.len()];
    let mut used = vec![0usize; caps.len()];
    for e in order {
        // Room exists: the caps sum to at least the expert count.
        let best = (0..caps.len())
            .filter(|&i| used[i] < caps[i])
            .min_by_key(|&i| (load[i], i))
            .unwrap_or(0);
        node_of[e] = best;
        load[best] += u128::from(counts[e]);
        used[best] += 1;
    }
    improve(counts, caps, &mut node_of, &mut load, &mut used);
    node_of
}

/// Local search: the best single move or swap between the most-loaded node and another
/// that lowers their larger load, until none does. Each step strictly lowers the sum of
/// squared loads, so it ends; the step count is bounded as well.
fn improve(
    counts: &[u64],
    caps: &[usize],
    node_of: &mut [usize],
    load: &mut [u128],
    used: &mut [usize],
) {
    let limit = 4 * counts.len() * caps.len() + 16;
    for _ in 0..limit {
        let Some(top) = (0..load.len()).max_by_key(|&i| (load[i], std::cmp::Reverse(i))) else {
            return;
        };
        // (new pair max, expert moved off top, expert moved onto top or none, node)
        let mut best: Option<(u128, usize, Option<usize>, usize)> = None;
        let on_top: Vec<usize> = (0..counts.len()).filter(|&e| node_of[e] == top).collect();
        for j in (0..load.len()).filter(|&j| j != top) {
            for &e in &on_top {
                let ce = u128::from(counts[e]);
                if used[j] < caps[j] {
                    let m = (load[top] - ce).max(load[j] + ce);
                    if m < load[top] && best.is_none_or(|b| m < b.0) {
                        best = Some((m, e, None, j));
                    }
                }
                for f in (0..counts.len()).filter(|&f| node_of[f] == j) {
                    let cf = u128::from(counts[f]);
                    if cf >= ce {
                        continue;
                    }
                    let m = (load[top] - ce + cf).max(load[j] + ce - cf);
                    if m < load[top] && best.is_none_or(|b| m < b.0) {
                        best = Some((m, e, Some(f), j));
                    }
                }
            }
        }
        let Some((_, e, swap, j)) = best else { return };
        let ce = u128::from(counts[e]);
        node_of[e] = j;
        load[top] -= ce;
        load[j] += ce;
        match swap {
            Some(f) => {
                let cf = u128::from(counts[f]);
                node_of[f] = top;
                load[j] -= cf;
                load[top] += cf;
            }
            None => {
                used[top] -= 1;
                used[j] += 1;
            }
        }
    }
}

/// A small deterministic generator (xorshift), so that the cases are reproducible.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Zipf-like counts (rank `r` routed `scale / (r + 1)` times plus noise), ranks shuffled.
fn zipf(experts: usize, scale: u64, seed: u64) -> Vec<u64> {
    let mut state = seed;
    let mut rank: Vec<u64> = (0..experts as u64).collect();
    for i in (1..experts).rev() {
        rank.swap(i, (next(&mut state) % (i as u64 + 1)) as usize);
    }
    rank.iter()
        .map(|&r| scale / (r + 1) + next(&mut state) % 8)
        .collect()
}

/// Caps for `nodes` nodes summing to at least `experts`: the even share plus `slack`.
fn caps_of(experts: usize, nodes: usize, slack: &[usize]) -> Vec<usize> {
    (0..nodes)
        .map(|i| experts.div_ceil(nodes) + slack[i % slack.len()])
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Random small layers, counts from a narrow range (many ties: the tie-breaking
    /// order must be the old one) or a wide one, caps from tight to none.
    #[test]
    fn same_assignment_as_the_exhaustive_search(
        counts in prop_oneof![
            proptest::collection::vec(0u64..6, 0..48),
            proptest::collection::vec(0u64..1_000_000, 0..48),
        ],
        nodes in 1usize..6,
        slack in proptest::collection::vec(0usize..4, 1..6),
    ) {
        let caps = caps_of(counts.len(), nodes, &slack);
        prop_assert_eq!(super::balance(&counts, &caps).unwrap(), old_balance(&counts, &caps));
    }
}

/// Larger layers (Zipf-like and uniform counts, 2 to 8 nodes, tight and loose caps):
/// the same assignment as the exhaustive search.
#[test]
fn same_assignment_on_larger_layers() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for case in 0..24u64 {
        let experts = 64 + (next(&mut state) % 200) as usize;
        let nodes = 2 + (next(&mut state) % 7) as usize;
        let counts = match case % 3 {
            0 => zipf(experts, 1_000_000, case),
            1 => (0..experts).map(|_| next(&mut state) % 1000).collect(),
            _ => (0..experts).map(|_| next(&mut state) % 3).collect(),
        };
        let caps = caps_of(experts, nodes, &[0, (case % 2) as usize * experts]);
        assert_eq!(
            super::balance(&counts, &caps).unwrap(),
            old_balance(&counts, &caps),
            "case {case}: {experts} experts on {nodes} nodes, caps {caps:?}"
        );
    }
}

/// The crate's ceiling (65,536 experts in a layer) on 8 nodes, tight caps and none: each
/// cap held, and the largest node load no more than an independent longest-first greedy
/// (written here, a scan of the nodes per expert) gives, nor below the trivial bound.
/// The exhaustive search took 27.5 s (release) on this size; no time is asserted, but the
/// normal (debug) run must get through it.
#[test]
fn the_ceiling_of_experts_on_eight_nodes() {
    let experts = 1 << 16; // model::MAX_EXPERTS_PER_LAYER (a higher layer)
    let counts = zipf(experts, 1_000_000_000, 7);
    for caps in [caps_of(experts, 8, &[0]), vec![experts; 8]] {
        let node_of = super::balance(&counts, &caps).unwrap();
        let mut on = vec![0usize; 8];
        node_of.iter().for_each(|&i| on[i] += 1);
        assert!(on.iter().zip(&caps).all(|(o, c)| o <= c), "{on:?} {caps:?}");
        let max = |node_of: &[usize]| {
            super::node_loads(&counts, node_of, 8)
                .into_iter()
                .max()
                .unwrap()
        };
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by_key(|&e| std::cmp::Reverse(counts[e]));
        let (mut greedy, mut load, mut used) = (vec![0; experts], [0u128; 8], [0usize; 8]);
        for e in order {
            let i = (0..8)
                .filter(|&i| used[i] < caps[i])
                .min_by_key(|&i| load[i])
                .unwrap();
            greedy[e] = i;
            load[i] += u128::from(counts[e]);
            used[i] += 1;
        }
        let total: u128 = counts.iter().map(|&c| u128::from(c)).sum();
        let got = max(&node_of);
        assert!(
            got <= max(&greedy),
            "{got} above the greedy's {}",
            max(&greedy)
        );
        assert!(
            got >= total
                .div_ceil(8)
                .max(u128::from(*counts.iter().max().unwrap()))
        );
    }
}
