//! The shape of a tensor as placed: its shape in elements row-major, its dtype as a block,
//! and the part of it a rank holds under a dense slice. A leaf of the room: the plan's
//! assignment, the views and the report all read it.

use crate::model::{Dtype, SliceAxis, TensorInfo};

/// The part of a dense tensor a rank holds under
/// [`PlacementPlan::dense_slice`](super::PlacementPlan::dense_slice): `len` entries from
/// `start` of `axis`, which has `extent` entries in the whole tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DenseSlice {
    /// The axis cut (rows: the outermost).
    pub axis: SliceAxis,
    /// First entry held.
    pub start: u64,
    /// Entries held.
    pub len: u64,
    /// Entries of the whole tensor's axis.
    pub extent: u64,
}

/// A tensor's element type as a block: ggml's quantised types pack `elements` elements
/// into `bytes` bytes; a plain type is a block of one element (sub-byte safetensors
/// types: the fewest elements that fill whole bytes, F4 2 in 1, F6 4 in 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// Elements per block.
    pub elements: u64,
    /// Bytes per block.
    pub bytes: u64,
}

impl Block {
    /// The block of `dtype`.
    pub(crate) fn of(dtype: Dtype) -> Block {
        match dtype {
            Dtype::Ggml(t) => Block {
                elements: u64::from(t.block_size()),
                bytes: u64::from(t.type_size()),
            },
            Dtype::Safetensors(d) => {
                let bits = d.bits().max(1);
                let elements = 8 / gcd(bits, 8);
                Block {
                    elements,
                    bytes: bits * elements / 8,
                }
            }
        }
    }
}

/// The bytes `shape` holds of `dtype` (whole blocks); `None` past u64 or where the
/// elements are no whole blocks. An attached view is made with its shape: a forged
/// manifest's shape must not describe more (or fewer) bytes than the view gives.
pub(crate) fn shape_bytes(dtype: Dtype, shape: &[u64]) -> Option<u64> {
    let elements = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    let block = Block::of(dtype);
    if block.elements == 0 || elements % block.elements != 0 {
        return None;
    }
    (elements / block.elements).checked_mul(block.bytes)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The shape row-major, outermost first, in elements: safetensors' as written, GGUF's
/// `ne` reversed.
pub(crate) fn normalized_shape(t: &TensorInfo) -> Vec<u64> {
    match t.dtype() {
        Dtype::Safetensors(_) => t.shape().to_vec(),
        Dtype::Ggml(_) => t.shape().iter().rev().copied().collect(),
    }
}
