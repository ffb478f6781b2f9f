//! What a slice must hold, from a tensor part's bytes, its rows and its dtype alone: the
//! check [`Checkpoint::verify`](crate::model::Checkpoint::verify) and
//! [`PlacedModel::verify`](crate::model::PlacedModel::verify) make of the pieces a slice
//! placed. Written apart from `geometry.rs` (which cut them) so that a wrong cut there is
//! not also the reference here: no units, no runs, only "a row is `bytes / rows` bytes,
//! and a slice of it is that many bytes times `len / extent`, exactly".

use crate::model::whole::Block;
use crate::model::{Dtype, SliceAxis};

/// The pieces a slice of one tensor part must be: `count` pieces of `len` bytes, the
/// first `offset` bytes from the part's start, each `stride` after the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expected {
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) count: u64,
    pub(crate) stride: u64,
}

/// One tensor part as bytes and rows: `bytes` in all, `outer` entries along its
/// outermost axis, `rows` rows of its innermost axis (the product of every other).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part {
    pub(crate) bytes: u64,
    pub(crate) outer: u64,
    pub(crate) rows: u64,
    pub(crate) dtype: Dtype,
}

/// `a * n / d` when it is a whole number.
fn exact(a: u64, n: u64, d: u64) -> Option<u64> {
    let p = a.checked_mul(n)?;
    (d > 0 && p.is_multiple_of(d)).then(|| p / d)
}

/// The pieces a packed slice must be: `len` entries in all, `len / parts` from `start`
/// of each of `parts` equal row blocks of the `extent` rows (one piece per block, each
/// `extent / parts` rows after the one before). `parts` 1 is [`expected`].
pub(crate) fn expected_parts(
    part: Part,
    (axis, start, len, extent): (SliceAxis, u64, u64, u64),
    parts: u64,
    whole: bool,
) -> Result<Expected, String> {
    if parts <= 1 || whole {
        return expected(part, (axis, start, len, extent), whole);
    }
    if axis != SliceAxis::Rows {
        return Err(format!(
            "a packed slice of {parts} blocks cuts rows, not {axis:?}"
        ));
    }
    let (Some(block), Some(each)) = (exact(extent, 1, parts), exact(len, 1, parts)) else {
        return Err(format!(
            "{len} of {extent} rows are not {parts} equal blocks' equal shares"
        ));
    };
    if start.saturating_add(each) > block {
        return Err(format!(
            "rows {start}..{} of each block run past its {block} rows",
            start + each
        ));
    }
    let one = expected(part, (axis, start, each, extent), false)?;
    let row = exact(part.bytes, 1, part.outer).unwrap_or(0);
    Ok(Expected {
        count: parts,
        stride: block * row,
        ..one
    })
}

/// The pieces `len` entries from `start` of `axis` (of `extent` entries) must be, or why
/// no pieces can be (a row that is not whole bytes, a cut inside an element's bytes or a
/// block of a block type). `whole`: a part kept whole (one piece, all of it).
pub(crate) fn expected(
    part: Part,
    (axis, start, len, extent): (SliceAxis, u64, u64, u64),
    whole: bool,
) -> Result<Expected, String> {
    let all = Expected {
        offset: 0,
        len: part.bytes,
        count: 1,
        stride: 0,
    };
    if whole || (start == 0 && len == extent) {
        return Ok(all);
    }
    match axis {
        SliceAxis::Rows => {
            if extent != part.outer {
                return Err(format!(
                    "the slice's axis has {extent} entries, the part's outermost {}",
                    part.outer
                ));
            }
            let row = exact(part.bytes, 1, part.outer).ok_or_else(|| {
                format!(
                    "{} bytes are not {} rows of whole bytes",
                    part.bytes, part.outer
                )
            })?;
            Ok(Expected {
                offset: start * row,
                len: len * row,
                count: 1,
                stride: 0,
            })
        }
        SliceAxis::Columns => {
            let row = exact(part.bytes, 1, part.rows).ok_or_else(|| {
                format!(
                    "{} bytes are not {} rows of whole bytes: no row past the first starts \
                     on a byte",
                    part.bytes, part.rows
                )
            })?;
            let block = Block::of(part.dtype);
            // A U8 part is its bytes (MXFP4's `…_blocks` are counted in their elements).
            let in_blocks = |x: u64| block.elements <= 1 || x.is_multiple_of(block.elements);
            let (Some(at), Some(held)) = (exact(row, start, extent), exact(row, len, extent))
            else {
                return Err(format!(
                    "columns {start}..{} of {extent} in rows of {row} bytes do not start and \
                     end on bytes",
                    start + len
                ));
            };
            if !in_blocks(start) || !in_blocks(len) {
                return Err(format!(
                    "columns {start}..{} cut through blocks of {} elements",
                    start + len,
                    block.elements
                ));
            }
            Ok(Expected {
                offset: at,
                len: held,
                count: part.rows,
                stride: row,
            })
        }
    }
}

/// The first way `pieces` (`(file offset, len)`, in order) are not `want` for a part
/// starting at file offset `base`.
pub(crate) fn mismatch(pieces: &[(u64, u64)], want: &Expected, base: u64) -> Option<String> {
    if pieces.len() as u64 != want.count {
        return Some(format!(
            "{} pieces where the slice's geometry has {} rows",
            pieces.len(),
            want.count
        ));
    }
    pieces.iter().enumerate().find_map(|(r, &(offset, len))| {
        let at = base + want.offset + r as u64 * want.stride;
        (offset != at || len != want.len).then(|| {
            format!(
                "row {r}: {len} bytes at file offset {offset}, the slice's geometry says \
                 {} at {at}",
                want.len
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::safetensors::Dtype as St;

    fn part(bytes: u64, shape: &[u64], dtype: St) -> Part {
        Part {
            bytes,
            outer: shape[0],
            rows: shape[..shape.len() - 1].iter().product(),
            dtype: Dtype::Safetensors(dtype),
        }
    }

    #[test]
    fn sub_byte_rows_that_are_not_whole_bytes_have_no_column_slice() {
        // Issue 31's cases: F4 [2,3] columns 0..2, F6_E2M3 [2,6] columns 0..4.
        let cols = |start, len, extent| (SliceAxis::Columns, start, len, extent);
        assert!(expected(part(3, &[2, 3], St::F4), cols(0, 2, 3), false).is_err());
        assert!(expected(part(9, &[2, 6], St::F6_E2M3), cols(0, 4, 6), false).is_err());
        // What the old geometry placed for F4 [2,3]: the whole 3 bytes, one piece.
        let f4 = part(4, &[2, 4], St::F4);
        let want = expected(f4, cols(0, 2, 4), false).unwrap();
        assert_eq!(
            want,
            Expected {
                offset: 0,
                len: 1,
                count: 2,
                stride: 2
            }
        );
        assert!(mismatch(&[(100, 3)], &want, 100).is_some());
        assert!(mismatch(&[(100, 1), (101, 1)], &want, 100).is_some());
        assert_eq!(mismatch(&[(100, 1), (102, 1)], &want, 100), None);
        // A column cut inside an element's bytes (F16: 2 bytes an element) is no slice.
        let f16 = part(16, &[2, 4], St::F16);
        assert!(expected(f16, cols(1, 2, 4), false).is_ok());
        assert_eq!(expected(f16, cols(1, 2, 4), false).unwrap().offset, 2);
        // Rows: whole rows of bytes only.
        let rows = (SliceAxis::Rows, 1, 1, 3);
        assert!(expected(part(9, &[3, 6], St::F4), rows, false).is_ok());
        let rows = (SliceAxis::Rows, 1, 1, 2);
        assert!(expected(part(3, &[2, 3], St::F4), rows, false).is_err());
    }

    #[test]
    fn a_packed_slice_is_one_piece_per_block() {
        // [8, 2] F16 (4-byte rows), rows 1..2 of each of 2 blocks of 4 rows.
        let p = part(32, &[8, 2], St::F16);
        let want = expected_parts(p, (SliceAxis::Rows, 1, 2, 8), 2, false).unwrap();
        let one = Expected {
            offset: 4,
            len: 4,
            count: 2,
            stride: 16,
        };
        assert_eq!(want, one);
        assert_eq!(mismatch(&[(104, 4), (120, 4)], &want, 100), None);
        // One range of rows 1..3 (an unpacked cut) is not it.
        assert!(mismatch(&[(104, 8)], &want, 100).is_some());
        // Rows past a block, blocks that do not divide, columns: no pieces.
        assert!(expected_parts(p, (SliceAxis::Rows, 3, 4, 8), 2, false).is_err());
        assert!(expected_parts(p, (SliceAxis::Rows, 0, 2, 8), 3, false).is_err());
        assert!(expected_parts(p, (SliceAxis::Columns, 0, 2, 2), 2, false).is_err());
    }
}
