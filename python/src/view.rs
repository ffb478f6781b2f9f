//! `View`: a read-only window into placed memory, exported without a copy through the
//! buffer protocol (`memoryview`, `numpy.asarray`) and DLPack (`numpy.from_dlpack`,
//! `torch.from_dlpack`).
//!
//! # Safety
//!
//! A view is an address, a shape and strides, and a keep-alive: an `Arc` whose drop is
//! the only thing that may end the bytes' life. For a store, the keep-alive holds the
//! store and a pin on the layer, and the store refuses to release a pinned layer's
//! slots; for a cache, it holds the cache and a pinned entry, which the cache never
//! evicts or writes. Every buffer export holds a reference to the view (`obj`), and every
//! DLPack export a clone of the keep-alive, so no address reaches Python that can dangle.
//! The bytes are never written while any of these lives: exports are read-only (the
//! buffer protocol refuses `PyBUF_WRITABLE`; versioned DLPack carries `READ_ONLY`).
#![allow(unsafe_code)]

use std::any::Any;
use std::ffi::{CStr, c_int, c_void};
use std::sync::Arc;

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::metadata::Dynamic;
use dlpark::python::{DlpackExporter, ExportAbi, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

/// What keeps a view's bytes alive and unchanged; dropped last.
pub type KeepAlive = Arc<dyn Any + Send + Sync>;

/// An element type: its name, its DLPack type, and its buffer-protocol format where
/// numpy has one.
#[derive(Debug, Clone, Copy)]
pub struct Elem {
    /// The checkpoint's name (`"BF16"`, `"Q4_K"`) or `"U8"` for raw bytes.
    pub name: &'static str,
    dl: DLDataType,
    format: Option<&'static CStr>,
    /// Bytes per element.
    pub size: usize,
}

const fn elem(
    name: &'static str,
    code: DLDataTypeCode,
    bits: u8,
    format: Option<&'static CStr>,
) -> Elem {
    Elem {
        name,
        dl: DLDataType::scalar(code, bits),
        format,
        size: bits as usize / 8,
    }
}

/// Raw bytes: what a dtype numpy and DLPack lack (GGML quant blocks) becomes.
pub const RAW: Elem = elem("U8", DLDataTypeCode::UINT, 8, Some(c"B"));

/// The element type of a checkpoint dtype name, if DLPack has one (`None`: raw bytes).
pub fn elem_of(name: &str) -> Option<Elem> {
    use DLDataTypeCode as C;
    Some(match name {
        "F64" => elem("F64", C::FLOAT, 64, Some(c"d")),
        "F32" => elem("F32", C::FLOAT, 32, Some(c"f")),
        "F16" => elem("F16", C::FLOAT, 16, Some(c"e")),
        "BF16" => elem("BF16", C::BFLOAT, 16, None),
        "I64" => elem("I64", C::INT, 64, Some(c"q")),
        "I32" => elem("I32", C::INT, 32, Some(c"i")),
        "I16" => elem("I16", C::INT, 16, Some(c"h")),
        "I8" => elem("I8", C::INT, 8, Some(c"b")),
        "U64" => elem("U64", C::UINT, 64, Some(c"Q")),
        "U32" => elem("U32", C::UINT, 32, Some(c"I")),
        "U16" => elem("U16", C::UINT, 16, Some(c"H")),
        "U8" => RAW,
        "BOOL" => elem("BOOL", C::BOOL, 8, Some(c"?")),
        "F8_E4M3" => elem("F8_E4M3", C::FLOAT8_E4M3FN, 8, None),
        "F8_E5M2" => elem("F8_E5M2", C::FLOAT8_E5M2, 8, None),
        _ => return None,
    })
}

/// A read-only, zero-copy array over placed memory.
///
/// `numpy.asarray(view)` / `memoryview(view)` go through the buffer protocol (the
/// checkpoint's dtype where numpy has one; BF16 and FP8 as raw `uint8` there);
/// `numpy.from_dlpack(view)` and `torch.from_dlpack(view)` through DLPack, with the
/// dtype DLPack has (BF16, FP8 included). GGML quant blocks are raw `uint8` everywhere.
///
/// Views are read-only. numpy honours it (`flags.writeable` is False). `torch.from_dlpack`
/// ignores DLPack's read-only flag: writing to such a tensor faults on a frozen store and
/// otherwise changes bytes every reader shares. Don't.
///
/// A view keeps its store (or cache entry) alive, also after `del store`; the store
/// refuses to release the slots of a layer while views into it are alive.
#[pyclass(frozen, module = "numapin")]
pub struct View {
    address: usize,
    elem: Elem,
    /// Elements per dimension, outermost first.
    shape: Vec<isize>,
    /// Bytes between elements per dimension.
    strides: Vec<isize>,
    /// The shape and strides the buffer protocol exports (the last dimension in bytes
    /// when numpy lacks the dtype).
    buffer_shape: Vec<isize>,
    buffer_strides: Vec<isize>,
    keep: KeepAlive,
}

impl View {
    /// A view of `shape` at `address` with byte `strides`, kept alive by `keep`.
    ///
    /// # Safety
    /// Every byte the shape and strides address lies inside memory that stays mapped,
    /// readable and unwritten for as long as `keep` lives.
    pub unsafe fn new(
        address: usize,
        elem: Elem,
        shape: Vec<isize>,
        strides: Vec<isize>,
        keep: KeepAlive,
    ) -> View {
        let (mut buffer_shape, mut buffer_strides) = (shape.clone(), strides.clone());
        if elem.format.is_none() {
            // numpy has no such dtype: the last dimension becomes its bytes.
            match (buffer_shape.last_mut(), buffer_strides.last_mut()) {
                (Some(n), Some(s)) => {
                    *n *= elem.size as isize;
                    *s = 1;
                }
                _ => {
                    buffer_shape.push(elem.size as isize);
                    buffer_strides.push(1);
                }
            }
        }
        View {
            address,
            elem,
            shape,
            strides,
            buffer_shape,
            buffer_strides,
            keep,
        }
    }

    /// A contiguous 1-D view of `len` elements.
    ///
    /// # Safety
    /// As [`View::new`].
    pub unsafe fn contiguous(address: usize, elem: Elem, shape: &[u64], keep: KeepAlive) -> View {
        let shape: Vec<isize> = shape.iter().map(|&n| n as isize).collect();
        let mut strides = vec![0isize; shape.len()];
        let mut step = elem.size as isize;
        for (s, n) in strides.iter_mut().zip(&shape).rev() {
            *s = step;
            step *= *n;
        }
        // SAFETY: the caller's contract.
        unsafe { View::new(address, elem, shape, strides, keep) }
    }

    fn c_contiguous(&self, shape: &[isize], strides: &[isize], item: isize) -> bool {
        let mut step = item;
        for (&n, &s) in shape.iter().zip(strides).rev() {
            if n > 1 && s != step {
                return false;
            }
            step *= n;
        }
        true
    }

    /// The address of the first element.
    pub fn address_of(&self) -> usize {
        self.address
    }

    fn nbytes(&self) -> usize {
        self.shape.iter().product::<isize>() as usize * self.elem.size
    }

    /// Bytes from the first byte the view reaches to one past the last (the gaps of a
    /// strided view included; 0 for a view with no elements).
    fn span_bytes(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        let (mut low, mut high) = (0isize, 0isize);
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            let reach = (n - 1) * s;
            if reach < 0 {
                low += reach;
            } else {
                high += reach;
            }
        }
        (high - low) as usize + self.elem.size
    }
}

/// The DLPack context: the view's keep-alive, dropped when the consumer is done.
struct Keep(#[allow(dead_code)] KeepAlive);

impl View {
    fn export<M: ManagedTensorBase>(&self, flags: DlpackFlags) -> PyResult<Managed<M>> {
        let item = self.elem.size as isize;
        let shape: Vec<i64> = self.shape.iter().map(|&n| n as i64).collect();
        let mut strides = Vec::with_capacity(self.strides.len());
        for &s in &self.strides {
            if s % item != 0 {
                return Err(PyBufferError::new_err(format!(
                    "a stride of {s} bytes is not a whole number of {}-byte elements: \
                     DLPack strides count elements (use the buffer protocol)",
                    item
                )));
            }
            strides.push((s / item) as i64);
        }
        let mut tensor = Dynamic::new(shape, strides)
            .initialize_as::<M>(Box::new(Keep(self.keep.clone())))
            .map_err(|e| PyValueError::new_err(format!("DLPack metadata: {e}")))?;
        tensor
            .set_data(self.address as *mut c_void)
            .set_dtype(self.elem.dl)
            .set_device(DLDevice::CPU);
        if !flags.is_empty() {
            tensor
                .set_flags(flags)
                .map_err(|e| PyValueError::new_err(format!("DLPack flags: {e}")))?;
        }
        // SAFETY: the data pointer and every element the shape and strides address stay
        // valid while the context (the keep-alive) lives, which the managed tensor owns;
        // shape and strides are copied into its allocation; the flags say read-only.
        Ok(unsafe { tensor.finish() })
    }
}

impl DlpackExporter for View {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::READ_ONLY
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.export(DlpackFlags::empty())
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.export(DlpackFlags::READ_ONLY)
    }
}

#[pymethods]
impl View {
    /// The element type: the checkpoint's dtype name (`"BF16"`), `"U8"` for raw bytes.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.elem.name
    }

    /// Elements per dimension, outermost first.
    #[getter]
    fn shape(&self) -> Vec<isize> {
        self.shape.clone()
    }

    /// Bytes between consecutive elements of each dimension.
    #[getter]
    fn strides(&self) -> Vec<isize> {
        self.strides.clone()
    }

    /// The address of the first byte (inside the store's region).
    #[getter]
    fn address(&self) -> usize {
        self.address
    }

    /// Bytes of the elements (not counting the gaps of a strided view).
    #[getter(nbytes)]
    fn py_nbytes(&self) -> usize {
        self.nbytes()
    }

    /// Bytes from the first byte the view reaches to one past the last: `nbytes` plus the
    /// gaps of a strided view (`address + span_bytes` is the end of the range it reads).
    #[getter(span_bytes)]
    fn py_span_bytes(&self) -> usize {
        self.span_bytes()
    }

    /// Always True: views never write (and the memory under a placed model's views is
    /// `PROT_READ` unless it was placed `writable=True`: a write faults).
    #[getter]
    fn readonly(&self) -> bool {
        true
    }

    fn __repr__(&self) -> String {
        format!(
            "View(dtype={}, shape={:?}, strides={:?}, address={:#x})",
            self.elem.name, self.shape, self.strides, self.address
        )
    }

    /// DLPack: a capsule over the same bytes (versioned ABI: read-only flag set; the
    /// legacy ABI cannot carry the flag).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        let flags = match request.abi() {
            ExportAbi::Versioned => DlpackFlags::READ_ONLY,
            ExportAbi::Legacy => DlpackFlags::empty(),
        };
        request.export_zero_copy(
            py,
            DLDevice::CPU,
            flags,
            || self.export::<DLManagedTensor>(DlpackFlags::empty()),
            || self.export::<DLManagedTensorVersioned>(DlpackFlags::READ_ONLY),
        )
    }

    /// DLPack: `(kDLCPU, 0)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (1, 0)
    }

    /// The buffer protocol: read-only, C-contiguous or strided as the view is.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("a null Py_buffer"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "numapin views are read-only: the bytes are shared by every reader",
            ));
        }
        let this = slf.get();
        let format = this.elem.format.unwrap_or(c"B");
        let item = if this.elem.format.is_some() {
            this.elem.size
        } else {
            1
        };
        let contiguous = this.c_contiguous(&this.buffer_shape, &this.buffer_strides, item as isize);
        if flags & ffi::PyBUF_STRIDES != ffi::PyBUF_STRIDES && !contiguous {
            return Err(PyBufferError::new_err(
                "a strided view: ask with PyBUF_STRIDES (numpy.asarray does)",
            ));
        }
        let len = this.buffer_shape.iter().product::<isize>() * item as isize;
        // SAFETY: `view` is the interpreter's Py_buffer to fill (non-null, checked). The
        // shape and strides arrays live in the view, which `obj` keeps alive until the
        // buffer is released; the format is a static string the reader does not write.
        unsafe {
            (*view).buf = this.address as *mut c_void;
            (*view).len = len;
            (*view).readonly = 1;
            (*view).itemsize = item as isize;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                format.as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = this.buffer_shape.len() as c_int;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                this.buffer_shape.as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                this.buffer_strides.as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        // Nothing was allocated per export: shape, strides and format live in the view.
    }
}

/// The shape and byte strides of `experts` slots at `stride`, each holding a C-contiguous
/// `inner`-shaped array of `elem`: `[experts, inner...]`, the slot stride outermost.
pub fn experts_layout(
    elem: Elem,
    experts: usize,
    stride: usize,
    inner: &[u64],
) -> (Vec<isize>, Vec<isize>) {
    let mut shape = vec![experts as isize];
    shape.extend(inner.iter().map(|&n| n as isize));
    let mut strides = vec![0isize; shape.len()];
    strides[0] = stride as isize;
    let mut step = elem.size as isize;
    for (s, &n) in strides[1..].iter_mut().zip(inner).rev() {
        *s = step;
        step *= n as isize;
    }
    (shape, strides)
}

/// The element type and shape of a tensor of `len` bytes: its own where DLPack has the
/// dtype and the sizes agree, else raw bytes (GGML quant blocks, sub-byte types).
pub fn tensor_layout(dtype: numapin::model::Dtype, shape: &[u64], len: usize) -> (Elem, Vec<u64>) {
    let raw = (RAW, vec![len as u64]);
    let Some(elem) = elem_of(&dtype.to_string()) else {
        return raw;
    };
    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    if elements.and_then(|n| n.checked_mul(elem.size as u64)) == Some(len as u64) {
        (elem, shape.to_vec())
    } else {
        raw
    }
}
