//! Kernel autotuning, the device's half: the settings, the process-wide table
//! of the variant chosen per adapter, kernel and shape class, and the optional
//! file that keeps those choices between runs. Which variants a kernel has and
//! what a shape class is belong to the layer that owns the kernel (the
//! matmul's are in `tensor/matmul_kernels.rs`); timing one variant on a device
//! is [`crate::device::gpu::Gpu::time_dispatch`].
//!
//! The table is per process, not per engine: every engine that opens the same
//! adapter (same name, backend and driver) shares what the others measured, so
//! tuning is paid once per process, or once per machine with a cache file.

use super::gpu::KernelSource;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// How a device picks among a kernel's variants (see
/// [`crate::EngineBuilder::autotune`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Autotune {
    /// Time the variants on first use; otherwise take the adapter class's
    /// default.
    pub(crate) on: bool,
    /// A file that keeps the choices between runs.
    pub(crate) cache: Option<PathBuf>,
    /// Variants that every dispatch of a kernel uses, by kernel name.
    pub(crate) pinned: Vec<(&'static str, String)>,
}

impl Default for Autotune {
    fn default() -> Self {
        Autotune {
            on: true,
            cache: None,
            pinned: Vec::new(),
        }
    }
}

impl Autotune {
    /// The variant pinned for `kernel`, if any.
    pub(crate) fn pinned(&self, kernel: &str) -> Option<&str> {
        self.pinned
            .iter()
            .find(|(k, _)| *k == kernel)
            .map(|(_, v)| v.as_str())
    }
}

/// How a tuned variant was chosen.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum TuneSource {
    /// Timed in this process: each variant that ran and its best time on the
    /// trial problem (variants that failed to compile or run are left out).
    Measured(Vec<(String, Duration)>),
    /// Read from the autotune cache file.
    Cached,
}

/// One choice of the autotuner (see [`crate::Engine::tuned_kernels`]).
///
/// ```
/// use lazyflow::{Device, Engine};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// for device in engine.devices() {
///     for t in engine.tuned_kernels(device) {
///         println!("{device}: {} {} -> {}", t.kernel, t.class, t.variant);
///     }
/// }
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TunedKernel {
    /// The kernel, e.g. `matmul`.
    pub kernel: String,
    /// The shape class the choice holds for, e.g. `m1024.k1024.n1024`.
    pub class: String,
    /// The variant chosen (see [`crate::matmul_kernels`]).
    pub variant: String,
    /// Whether it was measured here or read from the cache file.
    pub source: TuneSource,
}

/// Adapter, kernel name, shape class.
type Key = (String, String, String);

#[derive(Default)]
struct Table {
    chosen: HashMap<Key, Chosen>,
    /// Cache files read so far.
    loaded: Vec<PathBuf>,
    /// Cache files that could not be written (reported once each).
    unwritable: Vec<PathBuf>,
}

struct Chosen {
    variant: String,
    source: TuneSource,
    /// FNV-1a of the variant's source when read from a file and not yet
    /// checked (at the first lookup, where the source is known); `None` when
    /// measured here or checked.
    hash: Option<u64>,
}

fn table() -> MutexGuard<'static, Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Held while a device times variants, so that two devices of one process
/// (lavapipe shares the CPU between them) never skew each other's trials.
pub(crate) fn exclusive() -> MutexGuard<'static, ()> {
    static TUNING: Mutex<()> = Mutex::new(());
    TUNING.lock().unwrap_or_else(|e| e.into_inner())
}

/// FNV-1a, 64 bits: stable across Rust releases (unlike `DefaultHasher`), which
/// a hash written to a file needs.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

const FORMAT: &str = "lazyflow-autotune-1";

/// Tabs and line breaks would break the file's fields.
fn field(s: &str) -> String {
    s.replace(['\t', '\n', '\r'], " ")
}

/// The entries of one cache file: adapter, kernel, class, variant, hash.
fn parse(text: &str) -> Vec<(Key, String, u64)> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split('\t').collect();
            match f.as_slice() {
                [FORMAT, adapter, kernel, class, variant, hash] => Some((
                    (adapter.to_string(), kernel.to_string(), class.to_string()),
                    variant.to_string(),
                    u64::from_str_radix(hash, 16).ok()?,
                )),
                _ => None,
            }
        })
        .collect()
}

fn line(key: &Key, variant: &str, hash: u64) -> String {
    format!(
        "{FORMAT}\t{}\t{}\t{}\t{}\t{hash:016x}\n",
        field(&key.0),
        field(&key.1),
        field(&key.2),
        field(variant)
    )
}

/// Reads `path` into the table once (a missing or unreadable file holds
/// nothing; entries measured in this process win over the file's).
fn load(table: &mut Table, path: &Path) {
    if table.loaded.iter().any(|p| p == path) {
        return;
    }
    table.loaded.push(path.to_path_buf());
    let Ok(text) = std::fs::read_to_string(path) else {
        return;
    };
    for (key, variant, hash) in parse(&text) {
        // Later lines win: a file appended to by several runs ends with the
        // newest choice.
        let keep = table
            .chosen
            .get(&key)
            .is_none_or(|c| c.source == TuneSource::Cached);
        if keep {
            table.chosen.insert(
                key,
                Chosen {
                    variant,
                    source: TuneSource::Cached,
                    hash: Some(hash),
                },
            );
        }
    }
}

/// The variant chosen for `kernel` in `class` on `adapter`, measured in this
/// process or read from the cache file, if its source is still the one
/// measured.
pub(crate) fn lookup(
    settings: &Autotune,
    adapter: &str,
    kernel: &KernelSource,
    class: &str,
) -> Option<String> {
    let mut table = table();
    if let Some(path) = &settings.cache {
        load(&mut table, path);
    }
    let key = (
        adapter.to_string(),
        kernel.name.to_string(),
        class.to_string(),
    );
    let chosen = table.chosen.get_mut(&key)?;
    if let Some(h) = chosen.hash {
        if h != fnv1a(&kernel.wgsl(&chosen.variant)) {
            return None;
        }
        // Checked once: later lookups do not generate the source again.
        chosen.hash = None;
    }
    Some(chosen.variant.clone())
}

/// Records a measured choice, and appends it to the cache file if there is
/// one. A file that cannot be written is reported once on stderr; tuning goes
/// on without it.
pub(crate) fn store(
    settings: &Autotune,
    adapter: &str,
    kernel: &KernelSource,
    class: &str,
    variant: &str,
    timings: Vec<(String, Duration)>,
) {
    let key = (
        adapter.to_string(),
        kernel.name.to_string(),
        class.to_string(),
    );
    let mut table = table();
    if let Some(path) = &settings.cache {
        let text = line(&key, variant, fnv1a(&kernel.wgsl(variant)));
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(text.as_bytes()));
        if let Err(e) = written {
            if !table.unwritable.iter().any(|p| p == path) {
                table.unwritable.push(path.clone());
                eprintln!(
                    "lazyflow: the autotune cache {} cannot be written ({e}); choices are kept in memory only",
                    path.display()
                );
            }
        }
    }
    table.chosen.insert(
        key,
        Chosen {
            variant: variant.to_string(),
            source: TuneSource::Measured(timings),
            hash: None,
        },
    );
}

/// Every choice known for `adapter`, sorted by kernel and class.
pub(crate) fn entries(adapter: &str) -> Vec<TunedKernel> {
    let table = table();
    let mut out: Vec<TunedKernel> = table
        .chosen
        .iter()
        .filter(|((a, _, _), _)| a == adapter)
        .map(|((_, kernel, class), c)| TunedKernel {
            kernel: kernel.clone(),
            class: class.clone(),
            variant: c.variant.clone(),
            source: c.source.clone(),
        })
        .collect();
    out.sort_by(|a, b| (&a.kernel, &a.class).cmp(&(&b.kernel, &b.class)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_line_reads_back_as_written() {
        let key = (
            "llvmpipe (vulkan, driver\tx)".to_string(),
            "matmul".to_string(),
            "m64.k64.n64".to_string(),
        );
        let text = line(&key, "d32x32t4x4", 0xdead_beef);
        let parsed = parse(&text);
        let expected = (
            "llvmpipe (vulkan, driver x)".to_string(),
            "matmul".to_string(),
            "m64.k64.n64".to_string(),
        );
        assert_eq!(parsed, [(expected, "d32x32t4x4".to_string(), 0xdead_beef)]);
    }

    #[test]
    fn lines_of_another_format_are_ignored() {
        let text = "garbage\nlazyflow-autotune-0\ta\tb\tc\td\t00\n\
                    lazyflow-autotune-1\ta\tmatmul\tc\tv\tnot-hex\n";
        assert!(parse(text).is_empty());
    }

    #[test]
    fn fnv1a_matches_its_published_values() {
        // From the FNV reference test vectors.
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
    }

    fn fake_source(_template: &'static str, spec: &str) -> String {
        format!("// variant {spec}")
    }

    #[test]
    fn a_cached_choice_whose_source_changed_is_not_used() {
        let dir = std::env::temp_dir().join(format!("lazyflow-tune-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cache.txt");
        let kernel = KernelSource {
            name: "tune_test_kernel",
            template: "",
            specialize: fake_source,
        };
        let good = line(
            &("adapter A".into(), kernel.name.into(), "small".into()),
            "v1",
            fnv1a(&kernel.wgsl("v1")),
        );
        let stale = line(
            &("adapter A".into(), kernel.name.into(), "large".into()),
            "v2",
            fnv1a("// an older source of v2"),
        );
        std::fs::write(&path, format!("{good}{stale}")).unwrap();
        let settings = Autotune {
            cache: Some(path.clone()),
            ..Autotune::default()
        };
        assert_eq!(
            lookup(&settings, "adapter A", &kernel, "small").as_deref(),
            Some("v1")
        );
        assert_eq!(lookup(&settings, "adapter A", &kernel, "large"), None);
        assert_eq!(lookup(&settings, "adapter B", &kernel, "small"), None);
        // A measured choice is appended and wins over the stale line.
        store(&settings, "adapter A", &kernel, "large", "v3", Vec::new());
        assert_eq!(
            lookup(&settings, "adapter A", &kernel, "large").as_deref(),
            Some("v3")
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(parse(&text).len(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
