//! SGLang's host indices (a torch tensor) read natively, under the GIL.
//!
//! Invariants:
//! 1. Only a `torch.Tensor` that is on the CPU, 1-D, contiguous and of an integer dtype
//!    SGLang's host indices may have (int64, int32, int16, int8, uint8) is read; anything else
//!    is `None`, and the caller takes the Python path (which names what is wrong).
//! 2. Its elements are copied out while the GIL is held and the tensor is referenced, so no
//!    other Python thread can free or resize its memory during the read; nothing points into
//!    the tensor afterwards.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The integer dtypes host indices may have: `(torch attribute, bytes, signed)`.
const INDEX_DTYPES: [(&str, usize, bool); 5] = [
    ("int64", 8, true),
    ("int32", 4, true),
    ("int16", 2, true),
    ("int8", 1, true),
    ("uint8", 1, false),
];

/// `torch.Tensor` and the index dtypes of [`INDEX_DTYPES`], imported once.
struct Torch {
    tensor: Py<PyType>,
    dtypes: Vec<(Py<PyAny>, usize, bool)>,
}

fn torch(py: Python<'_>) -> PyResult<&Torch> {
    static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
    TORCH.get_or_try_init(py, || {
        let m = py.import("torch")?;
        let tensor = m.getattr("Tensor")?.cast_into::<PyType>()?.unbind();
        let dtypes = INDEX_DTYPES
            .iter()
            .map(|&(name, size, signed)| Ok((m.getattr(name)?.unbind(), size, signed)))
            .collect::<PyResult<_>>()?;
        Ok(Torch { tensor, dtypes })
    })
}

/// The elements of `t` as `i64` when it is a tensor invariant 1 accepts, else `None`.
pub fn read(t: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    let py = t.py();
    let torch = torch(py)?;
    if !t.is_instance(torch.tensor.bind(py).as_any())? {
        return Ok(None);
    }
    let dtype = t.getattr(pyo3::intern!(py, "dtype"))?;
    let Some(&(_, size, signed)) = torch.dtypes.iter().find(|(d, _, _)| d.is(&dtype)) else {
        return Ok(None);
    };
    if !t.getattr(pyo3::intern!(py, "is_cpu"))?.is_truthy()?
        || t.call_method0(pyo3::intern!(py, "dim"))?.extract::<i64>()? != 1
        || !t
            .call_method0(pyo3::intern!(py, "is_contiguous"))?
            .is_truthy()?
        || t.call_method0(pyo3::intern!(py, "element_size"))?
            .extract::<usize>()?
            != size
    {
        return Ok(None);
    }
    let n: usize = t.call_method0(pyo3::intern!(py, "numel"))?.extract()?;
    if n == 0 {
        return Ok(Some(Vec::new()));
    }
    let ptr: usize = t.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
    if ptr == 0 {
        return Ok(None);
    }
    // SAFETY: `t` is a CPU, contiguous, 1-D tensor of `n` elements of `size` bytes (checked
    // above), so `data_ptr()` points at `n × size` readable bytes of its storage; we hold the
    // GIL and a reference to `t` for the whole read, so no Python code can free or resize it
    // meanwhile (invariant 2). Bytes have no alignment requirement.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, n * size) };
    let v = bytes
        .chunks_exact(size)
        .map(|c| match (size, signed) {
            (8, _) => i64::from_ne_bytes(c.try_into().unwrap_or([0; 8])),
            (4, _) => i64::from(i32::from_ne_bytes(c.try_into().unwrap_or([0; 4]))),
            (2, _) => i64::from(i16::from_ne_bytes(c.try_into().unwrap_or([0; 2]))),
            (_, true) => i64::from(c[0] as i8),
            (_, false) => i64::from(c[0]),
        })
        .collect();
    Ok(Some(v))
}
