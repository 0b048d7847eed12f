//! Fashion-MNIST: the IDX reader, the data set, and seeded minibatches.
//!
//! ```no_run
//! use lazyflow::data::FashionMnist;
//! use lazyflow::Engine;
//! let engine = Engine::builder().build().unwrap();
//! let data = FashionMnist::load(None).unwrap(); // LAZYFLOW_DATA, else Debian's path
//! let (train, valid) = data.train.split(10_000, 0);
//! for (x, y) in train.batches(&engine, 256, 1) {
//!     assert_eq!(x.dims()[1..], [1, 28, 28]);
//!     assert_eq!(y.len(), x.dims()[0]);
//! }
//! # let _ = valid;
//! ```

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::Engine;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Where Debian's `dataset-fashion-mnist` package installs the files.
pub const DEBIAN_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The file names of the four parts, gzipped (plain files without `.gz` are
/// read too).
const FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

fn data_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Data {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// An IDX array of unsigned bytes: its dimensions and its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Idx {
    /// The dimensions, outermost first.
    pub dims: Vec<usize>,
    /// The bytes, row-major.
    pub data: Vec<u8>,
}

impl Idx {
    /// Parses IDX bytes (gzipped or not; gzip is recognised by its magic
    /// bytes). Errors name `path`: a wrong magic number, a type other than
    /// unsigned bytes, or fewer bytes than the dimensions promise.
    ///
    /// ```
    /// use lazyflow::data::Idx;
    /// let bytes = [0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9];
    /// let idx = Idx::parse(&bytes, "labels".as_ref()).unwrap();
    /// assert_eq!((idx.dims, idx.data), (vec![3], vec![7, 8, 9]));
    /// assert!(Idx::parse(&bytes[..10], "labels".as_ref()).is_err()); // truncated
    /// ```
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Idx> {
        let unzipped;
        let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(bytes)
                .read_to_end(&mut out)
                .map_err(|e| data_err(path, format!("not a valid gzip file: {e}")))?;
            unzipped = out;
            &unzipped[..]
        } else {
            bytes
        };
        if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
            return Err(data_err(
                path,
                format!(
                    "not an IDX file: wrong magic number {:02x?} (expected 00 00 08 <rank>)",
                    &bytes[..bytes.len().min(4)]
                ),
            ));
        }
        if bytes[2] != 0x08 {
            return Err(data_err(
                path,
                format!(
                    "IDX element type {:#04x} is not unsigned bytes (0x08)",
                    bytes[2]
                ),
            ));
        }
        let rank = bytes[3] as usize;
        let header = 4 + 4 * rank;
        if bytes.len() < header {
            return Err(data_err(path, format!("truncated: the header of a rank-{rank} IDX file needs {header} bytes, the file has {}", bytes.len())));
        }
        let dims: Vec<usize> = (0..rank)
            .map(|i| {
                let b = &bytes[4 + 4 * i..8 + 4 * i];
                u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
            })
            .collect();
        let len = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| data_err(path, format!("dimensions {dims:?} overflow")))?;
        let body = &bytes[header..];
        if body.len() < len {
            return Err(data_err(
                path,
                format!(
                    "truncated: dimensions {dims:?} need {len} bytes of data, the file has {}",
                    body.len()
                ),
            ));
        }
        Ok(Idx {
            dims,
            data: body[..len].to_vec(),
        })
    }

    /// Reads and parses an IDX file.
    pub fn read(path: &Path) -> Result<Idx> {
        let bytes = std::fs::read(path).map_err(|e| data_err(path, format!("cannot read: {e}")))?;
        Idx::parse(&bytes, path)
    }
}

/// Images with their labels: pixels scaled to `[0, 1]`, on the host.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// `len * rows * cols` pixels, row-major.
    pub images: Vec<f32>,
    /// One class per image.
    pub labels: Vec<u32>,
    /// Image height.
    pub rows: usize,
    /// Image width.
    pub cols: usize,
}

impl Dataset {
    /// From an IDX image array (`[n, rows, cols]`) and an IDX label array
    /// (`[n]`); errors if the counts disagree.
    pub fn from_idx(images: Idx, labels: Idx, path: &Path) -> Result<Dataset> {
        if images.dims.len() != 3 || labels.dims.len() != 1 {
            return Err(data_err(
                path,
                format!(
                    "expected images [n, rows, cols] and labels [n], got {:?} and {:?}",
                    images.dims, labels.dims
                ),
            ));
        }
        if images.dims[0] != labels.dims[0] {
            return Err(data_err(
                path,
                format!("{} images but {} labels", images.dims[0], labels.dims[0]),
            ));
        }
        Ok(Dataset {
            images: images.data.iter().map(|&p| p as f32 / 255.0).collect(),
            labels: labels.data.iter().map(|&l| l as u32).collect(),
            rows: images.dims[1],
            cols: images.dims[2],
        })
    }

    /// The number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    fn pick(&self, indices: &[usize]) -> Dataset {
        let px = self.rows * self.cols;
        let mut images = Vec::with_capacity(indices.len() * px);
        for &i in indices {
            images.extend_from_slice(&self.images[i * px..(i + 1) * px]);
        }
        Dataset {
            images,
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// The first `n` images (all if fewer).
    pub fn take(&self, n: usize) -> Dataset {
        let n = n.min(self.len());
        self.pick(&(0..n).collect::<Vec<_>>())
    }

    /// A seeded random split into `len - valid` training and `valid`
    /// validation images.
    pub fn split(&self, valid: usize, seed: u64) -> (Dataset, Dataset) {
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        let valid = valid.min(self.len());
        let (v, t) = order.split_at(valid);
        (self.pick(t), self.pick(v))
    }

    /// Minibatches of at most `batch` images in an order shuffled by `seed`
    /// (`[b, 1, rows, cols]` tensors on the CPU, with their labels); the last
    /// one may be smaller.
    pub fn batches<'d>(&'d self, engine: &Engine, batch: usize, seed: u64) -> Batches<'d> {
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        Batches {
            data: self,
            engine: engine.clone(),
            order,
            batch: batch.max(1),
            next: 0,
        }
    }

    /// Minibatches in order (for evaluation).
    pub fn batches_in_order<'d>(&'d self, engine: &Engine, batch: usize) -> Batches<'d> {
        Batches {
            data: self,
            engine: engine.clone(),
            order: (0..self.len()).collect(),
            batch: batch.max(1),
            next: 0,
        }
    }
}

/// An iterator over minibatches (see [`Dataset::batches`]).
pub struct Batches<'d> {
    data: &'d Dataset,
    engine: Engine,
    order: Vec<usize>,
    batch: usize,
    next: usize,
}

impl Iterator for Batches<'_> {
    type Item = (Tensor, Vec<u32>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.order.len() {
            return None;
        }
        let end = (self.next + self.batch).min(self.order.len());
        let part = self.data.pick(&self.order[self.next..end]);
        self.next = end;
        let n = part.len();
        let x = Tensor::from_vec_in(&self.engine, part.images, [n, 1, part.rows, part.cols])
            .expect("the lengths agree by construction");
        Some((x, part.labels))
    }
}

/// Fashion-MNIST's training and test sets.
#[derive(Clone, Debug)]
pub struct FashionMnist {
    /// 60,000 training images.
    pub train: Dataset,
    /// 10,000 test images.
    pub test: Dataset,
}

impl FashionMnist {
    /// Loads the data set from `dir`, else from `LAZYFLOW_DATA`, else from
    /// Debian's path ([`DEBIAN_DIR`]). A missing data set is an error that says
    /// how to get it.
    pub fn load(dir: Option<&Path>) -> Result<FashionMnist> {
        let dir: PathBuf = match dir {
            Some(d) => d.to_path_buf(),
            None => std::env::var_os("LAZYFLOW_DATA")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEBIAN_DIR)),
        };
        let file = |name: &str| -> Result<PathBuf> {
            let gz = dir.join(format!("{name}.gz"));
            let plain = dir.join(name);
            if gz.is_file() {
                Ok(gz)
            } else if plain.is_file() {
                Ok(plain)
            } else {
                Err(data_err(
                    &gz,
                    format!(
                        "Fashion-MNIST not found (neither {name}.gz nor {name} in {}). \
                         Install Debian's package (apt-get install dataset-fashion-mnist, \
                         which puts it in {DEBIAN_DIR}), or download the four IDX files \
                         and pass their directory (--data DIR or LAZYFLOW_DATA)",
                        dir.display()
                    ),
                ))
            }
        };
        let paths: Vec<PathBuf> = FILES.iter().map(|f| file(f)).collect::<Result<_>>()?;
        let part = |i: usize| -> Result<Dataset> {
            let images = Idx::read(&paths[i])?;
            let labels = Idx::read(&paths[i + 1])?;
            Dataset::from_idx(images, labels, &paths[i + 1])
        };
        Ok(FashionMnist {
            train: part(0)?,
            test: part(2)?,
        })
    }
}
