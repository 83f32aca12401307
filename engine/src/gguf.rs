//! GGUF reader (versions 2 and 3): header, metadata, tensor table, aligned data section, mmap.
//!
//! Every length and offset is checked against the file size, so a truncated or corrupt file is
//! an error naming the file and what is wrong, never a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kernels::DType;

use crate::error::{EngineError, Result};

const MAGIC: &[u8; 4] = b"GGUF";

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// Array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a float, if numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// Dimensions, innermost first (GGML's `ne`).
    pub dims: Vec<u64>,
    /// GGML type id (may be a type tandem does not support).
    pub type_id: u32,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Size of the data in bytes (0 when the type is unsupported).
    pub size: usize,
}

/// An opened GGUF file.
pub struct Gguf {
    path: PathBuf,
    /// GGUF version.
    pub version: u32,
    /// Metadata key-value pairs.
    pub metadata: HashMap<String, Value>,
    /// Tensor table by name.
    pub tensors: HashMap<String, TensorInfo>,
    map: Arc<memmap2::Mmap>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                EngineError::model(
                    self.path,
                    format!(
                        "truncated GGUF file: {what} needs {n} bytes at offset {}, file has {}",
                        self.pos,
                        self.buf.len()
                    ),
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        // Any length larger than the file is corrupt; checking here avoids huge allocations.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len())
            .ok_or_else(|| {
                EngineError::model(
                    self.path,
                    format!(
                        "corrupt GGUF file: {what} has length {n} at offset {}",
                        self.pos
                    ),
                )
            })
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| {
            EngineError::model(self.path, format!("corrupt GGUF file: {what} is not UTF-8"))
        })
    }
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        let what = &format!("value of {key}");
        Ok(match ty {
            0 => Value::U64(self.take(1, what)?[0] as u64),
            1 => Value::I64(self.take(1, what)?[0] as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2")) as u64),
            3 => Value::I64(i16::from_le_bytes(self.take(2, what)?.try_into().expect("2")) as i64),
            4 => Value::U64(self.u32(what)? as u64),
            5 => Value::I64(self.u32(what)? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32(what)?) as f64),
            7 => Value::Bool(self.take(1, what)?[0] != 0),
            8 => Value::Str(self.string(what)?),
            9 if depth == 0 => {
                let ety = self.u32(what)?;
                let n = self.len(what)?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.u64(what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(what)?)),
            _ => {
                return Err(EngineError::model(
                    self.path,
                    format!("corrupt GGUF file: {key} has unknown value type {ty}"),
                ))
            }
        })
    }
}

impl Gguf {
    /// Opens and parses a GGUF file; tensor data stay in the memory map.
    pub fn open(path: &Path) -> Result<Gguf> {
        let file = std::fs::File::open(path).map_err(|source| EngineError::Io {
            path: path.into(),
            source,
        })?;
        // SAFETY: the map is read-only; tandem does not modify model files while they are in use.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| EngineError::Io {
            path: path.into(),
            source,
        })?;
        let mut c = Cursor {
            buf: &map,
            pos: 0,
            path,
        };
        if c.take(4, "magic").ok() != Some(MAGIC.as_slice()) {
            return Err(EngineError::model(
                path,
                "not a GGUF file (missing GGUF magic)",
            ));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(EngineError::model(
                path,
                format!("unsupported GGUF version {version} (tandem reads 2 and 3)"),
            ));
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let v = c.value(ty, &key, 0)?;
            metadata.insert(key, v);
        }
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let nd = c.u32("tensor rank")? as usize;
            if nd > 4 {
                return Err(EngineError::model(
                    path,
                    format!("tensor {name}: rank {nd} exceeds 4"),
                ));
            }
            let dims = (0..nd)
                .map(|_| c.u64("tensor dims"))
                .collect::<Result<Vec<_>>>()?;
            let type_id = c.u32("tensor type")?;
            let off = c.u64("tensor offset")?;
            infos.push((name, dims, type_id, off));
        }
        let align = match metadata.get("general.alignment") {
            Some(v) => v.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                EngineError::model(path, "general.alignment is not a power of two")
            })? as usize,
            None => 32,
        };
        let data_start = c.pos.div_ceil(align) * align;
        let mut tensors = HashMap::new();
        for (name, dims, type_id, off) in infos {
            let count = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let size = match (DType::from_ggml_id(type_id), count) {
                (Some(dt), Some(count)) => {
                    let row = dims.first().copied().unwrap_or(1) as usize;
                    let bytes = dt.row_bytes(row).ok_or_else(|| {
                        EngineError::model(path, format!("tensor {name}: row of {row} is not a whole number of {dt:?} blocks"))
                    })?;
                    bytes * (count as usize / row.max(1))
                }
                (None, _) => 0,
                (_, None) => {
                    return Err(EngineError::model(
                        path,
                        format!("tensor {name}: dimensions overflow"),
                    ))
                }
            };
            let offset = usize::try_from(off)
                .ok()
                .and_then(|o| o.checked_add(data_start));
            let offset = offset.filter(|o| o.checked_add(size).is_some_and(|e| e <= map.len())).ok_or_else(|| {
                EngineError::model(
                    path,
                    format!("truncated GGUF file: tensor {name} ({size} bytes at data offset {off}) lies past the end of the file ({} bytes)", map.len()),
                )
            })?;
            if offset % align != 0 {
                return Err(EngineError::model(
                    path,
                    format!("tensor {name} is not aligned to {align} bytes"),
                ));
            }
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    dims,
                    type_id,
                    offset,
                    size,
                },
            );
        }
        Ok(Gguf {
            path: path.into(),
            version,
            metadata,
            tensors,
            map: Arc::new(map),
        })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The memory map holding the tensor data.
    pub fn map(&self) -> Arc<memmap2::Mmap> {
        self.map.clone()
    }

    /// A required metadata value.
    pub fn get(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| EngineError::model(&self.path, format!("missing metadata key {key}")))
    }

    /// A required unsigned integer metadata value.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)?.as_u64().ok_or_else(|| {
            EngineError::model(
                &self.path,
                format!("metadata {key} is not an unsigned integer"),
            )
        })
    }

    /// A required string metadata value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get(key)?.as_str().ok_or_else(|| {
            EngineError::model(&self.path, format!("metadata {key} is not a string"))
        })
    }

    /// A required array of strings.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>> {
        let arr = self.get(key)?.as_array().ok_or_else(|| {
            EngineError::model(&self.path, format!("metadata {key} is not an array"))
        })?;
        arr.iter()
            .map(|v| {
                v.as_str().ok_or_else(|| {
                    EngineError::model(&self.path, format!("metadata {key} holds a non-string"))
                })
            })
            .collect()
    }

    /// A tensor by name, as a matrix of `dims[1]` rows by `dims[0]` columns (vectors are one row).
    #[cfg(feature = "runtime")]
    pub fn matrix(&self, name: &str) -> Result<kernels::Matrix> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::model(&self.path, format!("missing tensor {name}")))?;
        let dt = DType::from_ggml_id(t.type_id).ok_or_else(|| {
            EngineError::model(
                &self.path,
                format!(
                    "tensor {name} has quantisation type {} (id {}), which tandem does not support (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)",
                    DType::ggml_name(t.type_id),
                    t.type_id
                ),
            )
        })?;
        let cols = t.dims.first().copied().unwrap_or(1) as usize;
        let rows = t.dims.iter().skip(1).product::<u64>() as usize;
        let backing: kernels::Backing = self.map.clone();
        kernels::Matrix::new(dt, rows, cols, backing, t.offset)
            .map_err(|e| EngineError::model(&self.path, format!("tensor {name}: {e}")))
    }

    /// A tensor by name dequantised to f32, checking its element count.
    #[cfg(feature = "runtime")]
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let m = self.matrix(name)?;
        if m.rows() * m.cols() != len {
            return Err(EngineError::model(
                &self.path,
                format!(
                    "tensor {name} has {} values, expected {len}",
                    m.rows() * m.cols()
                ),
            ));
        }
        let mut out = vec![0f32; len];
        for r in 0..m.rows() {
            m.dequantize_row(r, &mut out[r * m.cols()..(r + 1) * m.cols()]);
        }
        Ok(out)
    }
}
