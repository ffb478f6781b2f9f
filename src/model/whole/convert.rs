//! Tensors placed in the dtype the framework holds: a class or a name pattern of the
//! [`PlacementPlan`] asks for a dtype ([`PlacementPlan::convert_class`],
//! [`PlacementPlan::convert_pattern`]; transformers keeps routers and router biases in
//! float32 where the file has BF16), and the tensor is converted once, at placement, into
//! the placed copy. Verification compares the placed bytes with the conversion of the
//! file's bytes; views carry the new dtype and byte size.
//!
//! Implemented: BF16 → F32 and F16 → F32 (exact: every BF16 and F16 value, NaN payloads
//! included, is an F32 value), and a dtype to itself (nothing to do). Anything else is
//! refused by name before anything is reserved.

use std::fmt;

use super::classes::TensorClass;
use super::glob::{collapse_stars, glob_match};
use super::plan::PlacementPlan;
use crate::error::{Error, Result, quote};
use crate::model::{Dtype, GgmlType, SafetensorsDtype};

/// An element encoding a conversion reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Bf16,
    F16,
    F32,
}

fn encoding(d: Dtype) -> Option<Encoding> {
    Some(match d {
        Dtype::Safetensors(SafetensorsDtype::BF16) | Dtype::Ggml(GgmlType::BF16) => Encoding::Bf16,
        Dtype::Safetensors(SafetensorsDtype::F16) | Dtype::Ggml(GgmlType::F16) => Encoding::F16,
        Dtype::Safetensors(SafetensorsDtype::F32) | Dtype::Ggml(GgmlType::F32) => Encoding::F32,
        _ => return None,
    })
}

/// One tensor's conversion at placement: the file's dtype and the placed one (F32 in
/// the file's family: a GGUF tensor stays a GGML type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Conversion {
    pub(crate) from: Dtype,
    pub(crate) to: Dtype,
}

impl fmt::Display for Conversion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.from, self.to)
    }
}

impl Conversion {
    /// The conversion of a tensor of dtype `from` asked to be `to`: `Ok(None)` when it
    /// already is; `Err(why)` for a conversion not implemented.
    pub(crate) fn of(from: Dtype, to: Dtype) -> std::result::Result<Option<Conversion>, String> {
        let implemented = "only BF16 and F16 convert, to F32";
        let (Some(a), Some(b)) = (encoding(from), encoding(to)) else {
            return Err(format!("{from} -> {to} is not implemented: {implemented}"));
        };
        if a == b {
            return Ok(None);
        }
        if b != Encoding::F32 {
            return Err(format!("{from} -> {to} is not implemented: {implemented}"));
        }
        let to = match from {
            Dtype::Ggml(_) => Dtype::Ggml(GgmlType::F32),
            Dtype::Safetensors(_) => Dtype::Safetensors(SafetensorsDtype::F32),
        };
        Ok(Some(Conversion { from, to }))
    }

    /// The placed bytes of `file_len` bytes of the file's dtype.
    pub(crate) fn placed_len(self, file_len: u64) -> u64 {
        file_len.saturating_mul(2)
    }

    /// Appends the conversion of `src` (the file's little-endian elements) to `out`.
    pub(crate) fn apply(self, src: &[u8], out: &mut Vec<u8>) {
        let from = encoding(self.from);
        out.reserve(src.len() * 2);
        for pair in src.chunks_exact(2) {
            let h = u16::from_le_bytes([pair[0], pair[1]]);
            let bits = match from {
                Some(Encoding::F16) => f16_bits_to_f32(h),
                _ => u32::from(h) << 16,
            };
            out.extend_from_slice(&bits.to_le_bytes());
        }
    }
}

/// An IEEE binary16 value's bits as binary32 bits (exact: subnormals normalised, the
/// NaN payload kept in the top mantissa bits as torch does).
fn f16_bits_to_f32(h: u16) -> u32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    match exp {
        0 if mant == 0 => sign,
        // mant × 2⁻²⁴, exact in binary32.
        0 => sign | (mant as f32 * (1.0 / 16_777_216.0)).to_bits(),
        0x1f => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 112) << 23) | (mant << 13),
    }
}

/// The dtype a text names: the safetensors spelling (`F32`, `BF16`, `F16`, …) or
/// numpy's and torch's (`float32`, `bfloat16`, `float16`, `torch.float32`).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the text.
pub(crate) fn parse_dtype(op: &'static str, text: &str) -> Result<Dtype> {
    let t = text.trim();
    let t = t.strip_prefix("torch.").unwrap_or(t);
    let alias = match t {
        "float32" | "float" => Some(SafetensorsDtype::F32),
        "float16" | "half" => Some(SafetensorsDtype::F16),
        "bfloat16" => Some(SafetensorsDtype::BF16),
        "float64" | "double" => Some(SafetensorsDtype::F64),
        _ => None,
    };
    alias
        .or_else(|| SafetensorsDtype::from_name(t))
        .map(Dtype::Safetensors)
        .or_else(|| {
            // A GGML type's name (`Q8_0`): what the text form writes for one.
            (GgmlType::ALL.iter())
                .find(|g| g.name() == t)
                .map(|&g| Dtype::Ggml(g))
        })
        .ok_or_else(|| {
            Error::bad_value(
                op,
                "dtype",
                quote(text),
                "not a dtype (F32, BF16, F16, … or float32, bfloat16, float16)",
            )
        })
}

impl std::str::FromStr for Dtype {
    type Err = Error;

    /// A dtype by its safetensors spelling (`F32`, `BF16`, `F16`, …) or numpy's and
    /// torch's (`float32`, `bfloat16`, `float16`, `torch.float32`): the target of
    /// [`PlacementPlan::convert_class`].
    ///
    /// ```
    /// use numapin::model::{Dtype, SafetensorsDtype};
    /// assert_eq!("float32".parse::<Dtype>()?, Dtype::Safetensors(SafetensorsDtype::F32));
    /// assert!("float33".parse::<Dtype>().is_err());
    /// # Ok::<(), numapin::Error>(())
    /// ```
    fn from_str(text: &str) -> Result<Dtype> {
        parse_dtype("Dtype", text)
    }
}

/// A target dtype as the text form reads it back: a GGML type spelled as a safetensors
/// dtype (`F32`, `F16`, `BF16`, `I8`, …) is that one (the placed dtype follows the
/// file's family either way, [`Conversion::of`]); `Dtype::Ggml(F32)` was written
/// `convert:F32` and read back as `Dtype::Safetensors(F32)`, another plan.
fn spelled(dtype: Dtype) -> Dtype {
    match dtype {
        Dtype::Ggml(g) => SafetensorsDtype::from_name(g.name()).map_or(dtype, Dtype::Safetensors),
        d => d,
    }
}

impl PlacementPlan {
    /// Every dense tensor of `class` is placed in `dtype` (converted once at placement
    /// into the placed copy, verified against the conversion of the file's bytes, its
    /// view in `dtype` and the new byte size). BF16 and F16 convert to F32; a tensor
    /// already in `dtype` is placed as it is; any other conversion is refused, naming
    /// the tensor, before anything is reserved; so are the routed experts' class and a
    /// converted tensor that is also sliced.
    #[must_use]
    pub fn convert_class(mut self, class: TensorClass, dtype: Dtype) -> Self {
        let dtype = spelled(dtype);
        self.convert_classes.retain(|(c, _)| *c != class);
        self.convert_classes.push((class, dtype));
        self
    }

    /// Every dense tensor whose name matches `glob` (as [`PlacementPlan::pattern`]) is
    /// placed in `dtype`, over the class conversions (the last matching pattern wins),
    /// as [`PlacementPlan::convert_class`]. A pattern that chooses no dense tensor is an
    /// error naming it.
    #[must_use]
    pub fn convert_pattern(mut self, glob: impl Into<String>, dtype: Dtype) -> Self {
        self.convert_patterns
            .push((collapse_stars(glob.into()), spelled(dtype)));
        self
    }

    /// The class conversions, in order.
    pub fn class_conversions(&self) -> &[(TensorClass, Dtype)] {
        &self.convert_classes
    }

    /// The pattern conversions, in order.
    pub fn pattern_conversions(&self) -> &[(String, Dtype)] {
        &self.convert_patterns
    }

    /// The dtype dense tensor `name` of `class` is asked to be in, and the index of the
    /// pattern that asked.
    pub(super) fn convert_for(
        &self,
        class: TensorClass,
        name: &str,
    ) -> Option<(Dtype, Option<usize>)> {
        if let Some(i) = self
            .convert_patterns
            .iter()
            .rposition(|(p, _)| glob_match(p, name))
        {
            return Some((self.convert_patterns[i].1, Some(i)));
        }
        self.convert_classes
            .iter()
            .find(|(c, _)| *c == class)
            .map(|(_, d)| (*d, None))
    }

    /// A text-form item `KEY=convert:DTYPE` (`dtype`: the text after `convert:`), for a
    /// bare key or a quoted pattern.
    pub(super) fn apply_convert(
        self,
        key: Option<&str>,
        pattern: Option<String>,
        dtype: &str,
    ) -> Result<Self> {
        let dtype = parse_dtype("PlacementPlan", dtype)?;
        match (pattern, key) {
            (Some(p), _) => Ok(self.convert_pattern(p, dtype)),
            (None, Some("experts")) => Err(Error::bad_value(
                "PlacementPlan",
                "plan item",
                quote(&format!("experts=convert:{dtype}")),
                "the routed experts are not converted",
            )),
            (None, Some("dense")) => Ok(TensorClass::DENSE
                .into_iter()
                .fold(self, |plan, c| plan.convert_class(c, dtype))),
            (None, Some(k)) => Ok(match TensorClass::from_name(k) {
                Some(class) => self.convert_class(class, dtype),
                None => self.convert_pattern(k, dtype),
            }),
            (None, None) => Ok(self),
        }
    }

    /// The conversions in the text form: `;CLASS=convert:F32`, `;PATTERN=convert:F32`.
    pub(super) fn write_conversions(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (class, dtype) in &self.convert_classes {
            write!(f, ";{class}=convert:{dtype}")?;
        }
        for (pattern, dtype) in &self.convert_patterns {
            f.write_str(";")?;
            super::text::write_pattern(f, pattern)?;
            write!(f, "=convert:{dtype}")?;
        }
        Ok(())
    }
}

/// The conversion of checkpoint tensor `name` (file dtype `from`) asked as `to` by the
/// plan: `None` when it already is `to`; refused by name when not implemented, for a
/// routed expert, or with a slice.
pub(super) fn conversion_of(
    name: &str,
    class: TensorClass,
    (from, to): (Dtype, Dtype),
    pattern: Option<&str>,
    sliced: bool,
) -> Result<Option<Conversion>> {
    let by = match pattern {
        Some(p) => format!("pattern {}", quote(p)),
        None => format!("class {class}"),
    };
    let op = match pattern {
        Some(_) => "PlacementPlan::convert_pattern",
        None => "PlacementPlan::convert_class",
    };
    let conversion = Conversion::of(from, to).map_err(|why| {
        Error::bad_value(
            op,
            "conversion",
            quote(name),
            format!("{why} (asked by {by})"),
        )
    })?;
    if conversion.is_some() && sliced {
        return Err(Error::bad_value(
            op,
            "conversion",
            quote(name),
            format!("the tensor is sliced, and a converted tensor is placed whole (asked by {by})"),
        ));
    }
    Ok(conversion)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_converts_as_the_hardware_does() {
        // Every binary16 value against Rust's own f32 arithmetic on its parts.
        for h in 0..=u16::MAX {
            let bits = f16_bits_to_f32(h);
            let sign = if h & 0x8000 != 0 { -1.0f64 } else { 1.0 };
            let exp = i32::from((h >> 10) & 0x1f);
            let mant = f64::from(h & 0x3ff);
            let want = match exp {
                0 => sign * mant * 2f64.powi(-24),
                0x1f if mant == 0.0 => sign * f64::INFINITY,
                0x1f => {
                    assert!(f32::from_bits(bits).is_nan(), "{h:#x}");
                    continue;
                }
                _ => sign * (1.0 + mant / 1024.0) * 2f64.powi(exp - 15),
            };
            assert_eq!(f64::from(f32::from_bits(bits)), want, "{h:#x}");
            assert_eq!(bits >> 31, u32::from(h >> 15), "{h:#x} sign");
        }
    }

    #[test]
    fn refuses_what_is_not_implemented() {
        let st = |d| Dtype::Safetensors(d);
        assert!(Conversion::of(st(SafetensorsDtype::I8), st(SafetensorsDtype::F32)).is_err());
        assert!(Conversion::of(st(SafetensorsDtype::F32), st(SafetensorsDtype::BF16)).is_err());
        assert!(Conversion::of(Dtype::Ggml(GgmlType::Q8_0), st(SafetensorsDtype::F32)).is_err());
        assert_eq!(
            Conversion::of(st(SafetensorsDtype::F32), st(SafetensorsDtype::F32)),
            Ok(None)
        );
        assert!(parse_dtype("t", "float33").is_err());
        assert_eq!(
            parse_dtype("t", "torch.float32").unwrap(),
            st(SafetensorsDtype::F32)
        );
    }
}
