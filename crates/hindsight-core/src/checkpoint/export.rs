//! One whole state dict out of a checkpoint, however many ranks saved it:
//! the `safetensors` file inference and other tools read. Sharded arrays are
//! assembled (every byte verified on the way); each array is named by its
//! key path joined with "." (`model.0.weight`), as torch names parameters.
//! Plain values (a step count, hyperparameters) are not tensors: they are
//! listed, not written. An array safetensors cannot hold is an error naming
//! its key, never a file with a weight missing.

use std::borrow::Cow;
use std::path::Path;

use safetensors::tensor::{Dtype, View};

use crate::checkpoint::cancel::Cancel;
use crate::checkpoint::format::{Array, ArrayLib, Node};
use crate::checkpoint::replica::Replica;
use crate::error::{Error, Result};

/// What an export wrote.
#[derive(Debug, Default)]
pub struct Exported {
    pub tensors: usize,
    pub bytes: u64,
    /// Key paths of plain values left out (not tensors).
    pub skipped: Vec<String>,
}

/// The safetensors dtype of an array's dtype (torch's name or numpy's `str`).
pub fn safetensors_dtype(lib: ArrayLib, dtype: &str) -> Option<Dtype> {
    Some(match (lib, dtype) {
        (ArrayLib::Torch, "bool") | (ArrayLib::Numpy, "|b1") => Dtype::BOOL,
        (ArrayLib::Torch, "uint8") | (ArrayLib::Numpy, "|u1") => Dtype::U8,
        (ArrayLib::Torch, "int8") | (ArrayLib::Numpy, "|i1") => Dtype::I8,
        (ArrayLib::Torch, "int16") | (ArrayLib::Numpy, "<i2") => Dtype::I16,
        (ArrayLib::Torch, "uint16") | (ArrayLib::Numpy, "<u2") => Dtype::U16,
        (ArrayLib::Torch, "float16") | (ArrayLib::Numpy, "<f2") => Dtype::F16,
        (ArrayLib::Torch, "bfloat16") => Dtype::BF16,
        (ArrayLib::Torch, "int32") | (ArrayLib::Numpy, "<i4") => Dtype::I32,
        (ArrayLib::Torch, "uint32") | (ArrayLib::Numpy, "<u4") => Dtype::U32,
        (ArrayLib::Torch, "float32") | (ArrayLib::Numpy, "<f4") => Dtype::F32,
        (ArrayLib::Torch, "int64") | (ArrayLib::Numpy, "<i8") => Dtype::I64,
        (ArrayLib::Torch, "uint64") | (ArrayLib::Numpy, "<u8") => Dtype::U64,
        (ArrayLib::Torch, "float64") | (ArrayLib::Numpy, "<f8") => Dtype::F64,
        (ArrayLib::Torch, "float8_e4m3fn") => Dtype::F8_E4M3,
        (ArrayLib::Torch, "float8_e5m2") => Dtype::F8_E5M2,
        _ => return None,
    })
}

struct Tensor<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: &'a [u8],
}

impl View for &Tensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Write the arrays of checkpoint `name` (or of the sub-tree at `path`) to
/// `out` as one safetensors file, durably (a crash leaves the old file or
/// the new one).
pub fn safetensors(
    replica: &Replica,
    name: &str,
    path: &[String],
    out: &Path,
    threads: usize,
    cancel: Cancel<'_>,
) -> Result<Exported> {
    let read = replica.read(name, path, threads, cancel)?;
    let mut report = Exported::default();
    let mut tensors: Vec<(String, Tensor<'_>)> = Vec::new();
    let mut buffers = read.buffers.iter();
    flatten(
        &read.node,
        &mut Vec::new(),
        &mut buffers,
        &mut tensors,
        &mut report,
        name,
    )?;
    report.tensors = tensors.len();
    report.bytes = tensors.iter().map(|(_, t)| t.data.len() as u64).sum();
    let views: Vec<(String, &Tensor<'_>)> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
    let mut info = std::collections::HashMap::new();
    info.insert("hindsight.checkpoint".to_string(), name.to_string());
    let bytes = safetensors::tensor::serialize(views, Some(info))
        .map_err(|e| Error::invalid(format!("checkpoint '{name}'"), format!("safetensors: {e}")))?;
    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    crate::durable::write_durable(out, &dir, &[&bytes], crate::durable::DirSync::Now)?;
    Ok(report)
}

fn flatten<'a>(
    node: &Node,
    path: &mut Vec<String>,
    buffers: &mut std::slice::Iter<'a, Vec<u8>>,
    out: &mut Vec<(String, Tensor<'a>)>,
    report: &mut Exported,
    name: &str,
) -> Result<()> {
    let key = || path.join(".");
    match node {
        Node::Array(a) => {
            let data = buffers
                .next()
                .ok_or_else(|| Error::internal("export: fewer buffers than arrays"))?;
            out.push((key(), tensor(a, data, &path.join("/"), name)?));
        }
        Node::Bytes(_) | Node::Pickle(_) => {
            buffers.next();
            report.skipped.push(path.join("/"));
        }
        Node::Dict(items) => {
            for (k, v) in items {
                path.push(k.key_label());
                flatten(v, path, buffers, out, report, name)?;
                path.pop();
            }
        }
        Node::List(items) | Node::Tuple(items) => {
            for (i, v) in items.iter().enumerate() {
                path.push(i.to_string());
                flatten(v, path, buffers, out, report, name)?;
                path.pop();
            }
        }
        Node::Sharded(_) => {
            return Err(Error::internal("export: a sharded array was not assembled"));
        }
        _ => report.skipped.push(path.join("/")),
    }
    Ok(())
}

fn tensor<'a>(a: &Array, data: &'a [u8], key: &str, name: &str) -> Result<Tensor<'a>> {
    let dtype = safetensors_dtype(a.lib, &a.dtype).ok_or_else(|| {
        Error::invalid(
            format!("key '{key}' of checkpoint '{name}'"),
            format!(
                "dtype {} has no safetensors equivalent: nothing was written",
                a.dtype
            ),
        )
    })?;
    let shape = a
        .shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| Error::internal("shape exceeds usize")))
        .collect::<Result<_>>()?;
    Ok(Tensor { dtype, shape, data })
}
