//! An append-only table of layers that hands out `&T` for the table's whole lifetime
//! while other layers are still being added: segments of doubling size, each allocated
//! once and never moved, with a `OnceLock` per entry.

use std::sync::OnceLock;

/// Layer indices below this fit (2^20 = 1,048,576 layers).
pub(crate) const MAX_INDEX: usize = (1 << SEGMENTS) - 1;
const SEGMENTS: usize = 20;

pub(crate) struct Table<T> {
    segments: [OnceLock<Box<[OnceLock<T>]>>; SEGMENTS],
}

/// Entry `i` lives in segment `k = log2(i + 1)` at `i + 1 - 2^k`; segment `k` has `2^k`
/// entries.
fn locate(i: usize) -> Option<(usize, usize)> {
    if i >= MAX_INDEX {
        return None;
    }
    let k = (usize::BITS - 1 - (i + 1).leading_zeros()) as usize;
    Some((k, i + 1 - (1 << k)))
}

impl<T> Table<T> {
    pub(crate) fn new() -> Self {
        Table {
            segments: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    fn cell(&self, i: usize) -> Option<&OnceLock<T>> {
        let (k, j) = locate(i)?;
        let segment =
            self.segments[k].get_or_init(|| (0..1 << k).map(|_| OnceLock::new()).collect());
        segment.get(j)
    }

    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        let (k, j) = locate(i)?;
        self.segments[k].get()?.get(j)?.get()
    }

    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        let (k, j) = locate(i)?;
        self.segments[k].get_mut()?.get_mut(j)?.get_mut()
    }

    /// Sets entry `i` once; gives the value back if it was set already (or `i` is too big).
    pub(crate) fn set(&self, i: usize, value: T) -> Result<(), T> {
        match self.cell(i) {
            Some(cell) => cell.set(value),
            None => Err(value),
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.segments.iter().enumerate().flat_map(|(k, seg)| {
            seg.get().into_iter().flat_map(move |s| {
                s.iter()
                    .enumerate()
                    .filter_map(move |(j, c)| Some(((1 << k) - 1 + j, c.get()?)))
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_land_where_they_are_asked_for() {
        let mut t = Table::new();
        for i in [0, 1, 2, 3, 6, 7, 100, 4095, MAX_INDEX - 1] {
            assert!(t.set(i, i * 10).is_ok(), "{i}");
        }
        assert_eq!(t.set(3, 0), Err(0));
        assert_eq!(t.set(MAX_INDEX, 0), Err(0));
        assert_eq!(t.get(100), Some(&1000));
        assert_eq!(t.get(5), None);
        let seen: Vec<usize> = t.iter().map(|(i, _)| i).collect();
        assert_eq!(seen, vec![0, 1, 2, 3, 6, 7, 100, 4095, MAX_INDEX - 1]);
        *t.get_mut(7).unwrap() = 1;
        assert_eq!(t.get(7), Some(&1));
    }
}
