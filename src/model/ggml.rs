//! The ggml type table: block size and bytes per block for every type llama.cpp writes.
//!
//! Taken from gguf-py's `GGML_QUANT_SIZES` (`gguf/constants.py`, gguf 0.19.0), which
//! mirrors ggml's `type_traits`; ids 4 and 5 (Q4_2, Q4_3) and 31–33 (Q4_0_4_4 …, the
//! repacked types llama.cpp no longer writes) and 36–38 (IQ4_NL_4_4 …) are retired, so an
//! id outside the table is [`CheckpointFault::UnknownType`](crate::CheckpointFault).
//! The fixture generator writes gguf-py's table beside the fixtures and the tests compare
//! it with this one.

/// `QK_K`: the super-block of the k-quants and i-quants.
const QK_K: u32 = 256;

macro_rules! ggml_types {
    ($($name:ident = $id:literal, $block:expr, $bytes:expr;)*) => {
        /// A ggml tensor type, as GGUF stores it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types)]
        #[non_exhaustive]
        pub enum GgmlType {
            $(
                #[doc = concat!("`GGML_TYPE_", stringify!($name), "` (", stringify!($id), ")")]
                $name = $id,
            )*
        }

        impl GgmlType {
            /// Every type in the table.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$name),*];

            /// The type with this id, if ggml has it.
            pub(crate) fn from_id(id: u32) -> Option<GgmlType> {
                match id {
                    $($id => Some(GgmlType::$name),)*
                    _ => None,
                }
            }

            /// ggml's name (`"Q8_0"`).
            pub fn name(self) -> &'static str {
                match self {
                    $(GgmlType::$name => stringify!($name),)*
                }
            }

            /// Elements per block (1 for plain types).
            pub fn block_size(self) -> u32 {
                match self {
                    $(GgmlType::$name => $block,)*
                }
            }

            /// Bytes per block.
            pub fn type_size(self) -> u32 {
                match self {
                    $(GgmlType::$name => $bytes,)*
                }
            }
        }
    };
}

ggml_types! {
    F32 = 0, 1, 4;
    F16 = 1, 1, 2;
    Q4_0 = 2, 32, 2 + 16;
    Q4_1 = 3, 32, 2 + 2 + 16;
    Q5_0 = 6, 32, 2 + 4 + 16;
    Q5_1 = 7, 32, 2 + 2 + 4 + 16;
    Q8_0 = 8, 32, 2 + 32;
    Q8_1 = 9, 32, 4 + 4 + 32;
    Q2_K = 10, QK_K, 2 + 2 + QK_K / 16 + QK_K / 4;
    Q3_K = 11, QK_K, 2 + QK_K / 4 + QK_K / 8 + 12;
    Q4_K = 12, QK_K, 2 + 2 + QK_K / 2 + 12;
    Q5_K = 13, QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12;
    Q6_K = 14, QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16;
    Q8_K = 15, QK_K, 4 + QK_K + QK_K / 8;
    IQ2_XXS = 16, QK_K, 2 + QK_K / 4;
    IQ2_XS = 17, QK_K, 2 + QK_K / 4 + QK_K / 32;
    IQ3_XXS = 18, QK_K, 2 + QK_K / 4 + QK_K / 8;
    IQ1_S = 19, QK_K, 2 + QK_K / 8 + QK_K / 16;
    IQ4_NL = 20, 32, 2 + 16;
    IQ3_S = 21, QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4;
    IQ2_S = 22, QK_K, 2 + QK_K / 4 + QK_K / 16;
    IQ4_XS = 23, QK_K, 2 + 2 + QK_K / 2 + QK_K / 64;
    I8 = 24, 1, 1;
    I16 = 25, 1, 2;
    I32 = 26, 1, 4;
    I64 = 27, 1, 8;
    F64 = 28, 1, 8;
    IQ1_M = 29, QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32;
    BF16 = 30, 1, 2;
    TQ1_0 = 34, QK_K, 2 + 4 * 13;
    TQ2_0 = 35, QK_K, 2 + 64;
    MXFP4 = 39, 32, 1 + 16;
    NVFP4 = 40, 64, 4 + 32;
    Q1_0 = 41, 128, 2 + 16;
}

impl GgmlType {
    /// Bytes of a tensor of this type with dims `ne` (`ne0` first): `ne0 / block ×
    /// type_size × ne1 × ne2 × …`. `Err` says why when `ne0` is not a multiple of the
    /// block size or the product overflows.
    pub(crate) fn tensor_bytes(self, ne: &[u64]) -> Result<u64, String> {
        let block = u64::from(self.block_size());
        let ne0 = ne.first().copied().unwrap_or(1);
        if ne0 % block != 0 {
            return Err(format!(
                "ne0 = {ne0} is not a multiple of {}'s block size {block}",
                self.name()
            ));
        }
        let mut bytes = (ne0 / block).checked_mul(u64::from(self.type_size()));
        for &d in ne.iter().skip(1) {
            bytes = bytes.and_then(|b| b.checked_mul(d));
        }
        bytes.ok_or_else(|| format!("{} × {ne:?} overflows 64 bits", self.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_retired_ids_are_unknown() {
        for &t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t as u32), Some(t));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(retired), None, "id {retired}");
        }
    }

    #[test]
    fn tensor_bytes_checks_blocks_and_overflow() {
        let q8 = GgmlType::Q8_0;
        assert_eq!(
            q8.tensor_bytes(&[64, 3, 2]),
            Ok(2 * u64::from(q8.type_size()) * 6)
        );
        assert!(
            q8.tensor_bytes(&[33, 1])
                .unwrap_err()
                .contains("block size 32")
        );
        assert!(
            GgmlType::F32
                .tensor_bytes(&[u64::MAX, 2])
                .unwrap_err()
                .contains("overflows")
        );
    }
}
