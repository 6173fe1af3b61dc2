//! Multi-rank checkpoints at the boundary: the part names, replicated-state
//! ownership and regions the core (`checkpoint::shard`, `checkpoint::parts`)
//! decides, converted for the Python layer (`hindsight.dist`).

use pyo3::prelude::*;

use hindsight_core as core;

use crate::buffer::Buffer;
use crate::errors::IntoPy;

/// A box of an array read from a checkpoint: row-major bytes in `data`.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
pub(crate) struct Region {
    pub(crate) lib: String,
    pub(crate) dtype: String,
    pub(crate) shape: Vec<u64>,
    pub(crate) data: Py<Buffer>,
}

impl Region {
    pub(crate) fn from_core(py: Python<'_>, r: core::checkpoint::parts::Region) -> PyResult<Self> {
        let lib = match r.lib {
            core::checkpoint::format::ArrayLib::Torch => "torch",
            core::checkpoint::format::ArrayLib::Numpy => "numpy",
        };
        Ok(Region {
            lib: lib.into(),
            dtype: r.dtype,
            shape: r.shape,
            data: Py::new(py, Buffer::new(r.data))?,
        })
    }
}

/// An array a load left out, for the caller to read its own boxes of
/// (core `replica::LeftOut`): the key path from the root, the whole shape.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
pub(crate) struct LeftOut {
    pub(crate) path: Vec<String>,
    pub(crate) dtype: String,
    pub(crate) shape: Vec<u64>,
}

impl LeftOut {
    pub(crate) fn from_core(l: core::checkpoint::replica::LeftOut) -> Self {
        LeftOut {
            path: l.path,
            dtype: l.dtype,
            shape: l.shape,
        }
    }
}

/// A load without some of its arrays: the tree (None in their places) and
/// the arrays left out.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
pub(crate) struct PartialTree {
    pub(crate) tree: Py<PyAny>,
    pub(crate) left_out: Vec<Py<LeftOut>>,
}

/// Which box of which array to read (`Store.read_regions`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
pub(crate) struct RegionRequest {
    pub(crate) path: Vec<String>,
    pub(crate) whole: Vec<u64>,
    pub(crate) offset: Vec<u64>,
    pub(crate) shape: Vec<u64>,
}

#[pymethods]
impl RegionRequest {
    #[new]
    #[pyo3(signature = (*, path, whole, offset, shape))]
    fn new(path: Vec<String>, whole: Vec<u64>, offset: Vec<u64>, shape: Vec<u64>) -> Self {
        RegionRequest {
            path,
            whole,
            offset,
            shape,
        }
    }
}

impl RegionRequest {
    pub(crate) fn to_core(&self) -> core::checkpoint::parts::RegionRequest {
        core::checkpoint::parts::RegionRequest {
            path: self.path.clone(),
            whole: self.whole.clone(),
            offset: self.offset.clone(),
            shape: self.shape.clone(),
        }
    }
}

/// Which rank writes each replicated item, and the digest every rank's part
/// carries so the commit can check that the ranks saw the same items.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
pub(crate) struct ReplicaPlan {
    pub(crate) owners: Vec<u64>,
    pub(crate) digest: String,
}

/// The plan for replicated items described by `items` (key, dtype, shape:
/// one string each, in the same order on every rank) of `sizes` bytes.
#[pyfunction]
fn plan_replicated(items: Vec<String>, sizes: Vec<u64>, world: u64) -> ReplicaPlan {
    ReplicaPlan {
        owners: core::checkpoint::shard::assign_owners(&sizes, world),
        digest: core::checkpoint::shard::replicated_digest(&items),
    }
}

/// The hidden name of `rank`'s part of checkpoint `name`.
#[pyfunction]
fn part_name(name: &str, rank: u64, world: u64, attempt: &str) -> PyResult<String> {
    core::checkpoint::shard::part_name(name, rank, world, attempt).py_err()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Region>()?;
    m.add_class::<RegionRequest>()?;
    m.add_class::<LeftOut>()?;
    m.add_class::<PartialTree>()?;
    m.add_class::<ReplicaPlan>()?;
    m.add_function(wrap_pyfunction!(plan_replicated, m)?)?;
    m.add_function(wrap_pyfunction!(part_name, m)?)?;
    m.add("META_REPLICATED", core::checkpoint::shard::META_REPLICATED)?;
    m.add("META_WORLD", core::checkpoint::shard::META_WORLD)?;
    Ok(())
}
