//! The matrix product's kernel variants and how one is picked: the WGSL of each
//! variant (generated from its tile shape), the shape classes the autotuner
//! keys its choices by, the trial problem it times, and the default per kind
//! of adapter when tuning is off. The table of choices, the cache file and
//! the timing itself are the device's (`device/tune.rs`, `Gpu::time_dispatch`).
//!
//! Every variant computes `out[z] = a[z] @ b[z or 0]` for row-major f32 `a`
//! (batch x m x k), `b` (batch x k x n, or one k x n for every batch entry) and
//! `out` (batch x m x n), with `info = [m, k, n, b_batched]` as the fourth
//! binding. A workgroup computes a tile of `out`; each invocation a block of
//! `tm` rows by `tn` columns (a `vec4` when `tn` is 4) held in registers. The
//! `v4` variants bind the operands as `array<vec4<f32>>` and step k by 4 (a
//! vec4 of a row of `a` times four vec4 rows of `b`), for products whose k
//! and n are multiples of 4.
//! Variants differ in tile and workgroup shape, vector width, and whether
//! they stage slices of `a` and `b` in workgroup memory ("shared") or read
//! straight from the buffers ("direct"). Which wins depends on the adapter:
//! on a discrete GPU the shared tiles, on lavapipe (which runs a workgroup's
//! invocations on one CPU core, where a barrier is a context switch) the
//! direct ones; sizes shift the balance, hence the tuning per shape class.

use crate::device::gpu::{Access, Gpu, GpuBuffer, Grid, KernelSource};
use crate::device::tune;
use std::fmt::Write;

/// The kernel's name in the pipeline cache and the autotuner's table.
const NAME: &str = "matmul";

/// One variant: workgroup of `wx` x `wy` invocations, each computing `tm` rows
/// by `tn` columns; `bk` is the depth of the slices staged in workgroup memory
/// (0: none, the variant reads the buffers directly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Variant {
    pub(crate) name: &'static str,
    wx: u32,
    wy: u32,
    tm: u32,
    tn: u32,
    bk: u32,
    /// Binds the operands as `array<vec4<f32>>` and steps k by 4: for
    /// products whose k and n are multiples of 4 (others take the same tile
    /// without it, see [`Variant::usable`]).
    v4: bool,
}

const fn variant(name: &'static str, wx: u32, wy: u32, tm: u32, tn: u32, bk: u32) -> Variant {
    Variant {
        name,
        wx,
        wy,
        tm,
        tn,
        bk,
        v4: false,
    }
}

/// A direct variant over vec4 bindings (see [`Variant::v4`]), `tn` (a
/// multiple of 4) columns per invocation.
const fn vector(name: &'static str, wx: u32, wy: u32, tm: u32, tn: u32) -> Variant {
    Variant {
        name,
        wx,
        wy,
        tm,
        tn,
        bk: 0,
        v4: true,
    }
}

/// Every variant the autotuner times. Names read `s` (shared) or `d` (direct),
/// the output tile (rows x columns), the slice depth, the block of one
/// invocation, and `v4` for vec4 bindings. On lavapipe the vec4 variants
/// with 16 or 32 columns per invocation run several times faster than the
/// best scalar one (`gpu_bench` prints every variant's trial time).
pub(crate) const VARIANTS: [Variant; 17] = [
    variant("s64x64k16t4x4", 16, 16, 4, 4, 16),
    variant("s32x32k16t4x4", 8, 8, 4, 4, 16),
    variant("s128x64k8t8x4", 16, 16, 8, 4, 8),
    variant("s16x16k16t1x1", 16, 16, 1, 1, 16),
    variant("d32x32t4x4", 8, 8, 4, 4, 0),
    variant("d64x32t8x4", 8, 8, 8, 4, 0),
    variant("d16x64t1x4", 16, 16, 1, 4, 0),
    variant("d16x16t1x1", 16, 16, 1, 1, 0),
    variant("d128x32t16x4", 8, 8, 16, 4, 0),
    variant("d64x64t8x4", 16, 8, 8, 4, 0),
    variant("d256x32t32x4", 8, 8, 32, 4, 0),
    vector("d256x32t32x4v4", 8, 8, 32, 4),
    vector("d128x64t16x8v4", 8, 8, 16, 8),
    vector("d128x128t16x16v4", 8, 8, 16, 16),
    vector("d256x128t32x16v4", 8, 8, 32, 16),
    vector("d512x128t64x16v4", 8, 8, 64, 16),
    vector("d256x256t32x32v4", 8, 8, 32, 32),
];

/// The names of the matrix product's kernel variants, for
/// [`crate::EngineBuilder::matmul_kernel`] (every one computes the same
/// product; they differ in speed).
///
/// ```
/// let names = lazyflow::matmul_kernels();
/// assert!(names.contains(&"s64x64k16t4x4"));
/// ```
pub fn matmul_kernels() -> Vec<&'static str> {
    VARIANTS.iter().map(|v| v.name).collect()
}

/// The variant named `name`.
pub(crate) fn find(name: &str) -> Option<&'static Variant> {
    VARIANTS.iter().find(|v| v.name == name)
}

/// Whether the vec4 variants compute a product of depth `k` and width `n`:
/// both multiples of 4, and not empty (a vec4 binding holds 16 bytes at
/// least).
fn vec4_aligned(k: usize, n: usize) -> bool {
    k > 0 && n > 0 && k.is_multiple_of(4) && n.is_multiple_of(4)
}

/// The variant used when tuning is off, or the problem is too small to time:
/// direct tiles on a CPU adapter (lavapipe: the fastest or near it at every
/// size measured), over vec4 bindings when k and n allow; the shared 64 x 64
/// tile elsewhere.
fn default_for(gpu: &Gpu, k: usize, n: usize) -> &'static Variant {
    let name = match (gpu.info.device_type == "cpu", vec4_aligned(k, n)) {
        (true, true) => "d256x128t32x16v4",
        (true, false) => "d128x32t16x4",
        (false, _) => "s64x64k16t4x4",
    };
    find(name).unwrap_or(&VARIANTS[0])
}

/// Below this many multiply-adds a matmul takes the default: its time is
/// mostly the submission, and no variant measurably wins.
const TUNE_MIN: usize = 1 << 18;

/// About how many multiply-adds one trial runs (see [`trial`]).
const TRIAL_BUDGET: usize = 1 << 24;

/// The shape class the autotuner keys a `m x k @ k x n` product by (as in
/// [`crate::TunedKernel::class`]): each of m, k, n rounded up to a power of 4
/// from 16 to 4096, or `big` above.
///
/// ```
/// assert_eq!(lazyflow::matmul_class(300, 200, 500), "m1024.k256.n1024");
/// ```
pub fn matmul_class(m: usize, k: usize, n: usize) -> String {
    let bucket = |x: usize| {
        [16, 64, 256, 1024, 4096]
            .into_iter()
            .find(|&b| x <= b)
            .map_or_else(|| "big".to_string(), |b| b.to_string())
    };
    format!("m{}.k{}.n{}", bucket(m), bucket(k), bucket(n))
}

/// The trial problem for `m x k x n`: the first `tm` rows of the product with
/// a depth of `tk`, about [`TRIAL_BUDGET`] multiply-adds, so that a 4096²
/// product is tuned in a fraction of a second of lavapipe. It keeps all of n
/// and at least 128 rows, so the grid stays as wide as the real one, and it
/// reads only within the real buffers (`tm <= m`, `tk <= k`).
fn trial(m: usize, k: usize, n: usize) -> (usize, usize) {
    let tk = (TRIAL_BUDGET / (m * n).max(1)).next_multiple_of(16).max(64);
    let tk = tk.min(k);
    let tm = (TRIAL_BUDGET / (n * tk).max(1))
        .next_multiple_of(128)
        .max(128);
    (tm.min(m), tk)
}

impl Variant {
    /// Whether the variant computes a product of depth `k` and width `n`.
    pub(crate) fn usable(&self, k: usize, n: usize) -> bool {
        !self.v4 || vec4_aligned(k, n)
    }

    /// This variant if it computes `k`, `n`; else `fallback`.
    fn for_shape(
        &'static self,
        k: usize,
        n: usize,
        fallback: &'static Variant,
    ) -> &'static Variant {
        if self.usable(k, n) {
            self
        } else {
            fallback
        }
    }

    fn rows(&self) -> u32 {
        self.wy * self.tm
    }

    fn cols(&self) -> u32 {
        self.wx * self.tn
    }

    /// The workgroups for a `batch x m x n` output.
    pub(crate) fn grid(&self, batch: usize, m: usize, n: usize) -> Grid {
        Grid::Exact(
            n.div_ceil(self.cols() as usize) as u32,
            m.div_ceil(self.rows() as usize) as u32,
            batch as u32,
        )
    }

    /// The variant's WGSL.
    fn wgsl(&self) -> String {
        let mut s = String::new();
        if self.v4 {
            self.vector_body(&mut s);
            return s;
        }
        let acc = if self.tn == 4 { "vec4<f32>" } else { "f32" };
        let _ = writeln!(
            s,
            "// matmul variant {}: generated by src/tensor/matmul_kernels.rs.\n\
             @group(0) @binding(0) var<storage, read> a: array<f32>;\n\
             @group(0) @binding(1) var<storage, read> b: array<f32>;\n\
             @group(0) @binding(2) var<storage, read_write> out: array<f32>;\n\
             @group(0) @binding(3) var<storage, read> info: array<u32>;",
            self.name
        );
        if self.bk > 0 {
            self.shared_body(&mut s, acc);
        } else {
            self.direct_body(&mut s, acc);
        }
        s
    }

    /// Slices of `bk` staged in workgroup memory, a barrier on each side of
    /// the multiply-adds.
    fn shared_body(&self, s: &mut String, acc: &str) {
        let (bm, bn, bk, tm, tn, wx) =
            (self.rows(), self.cols(), self.bk, self.tm, self.tn, self.wx);
        let threads = self.wx * self.wy;
        let _ = writeln!(
            s,
            "var<workgroup> a_tile: array<f32, {a_len}>;\n\
             var<workgroup> b_tile: array<{acc}, {b_len}>;\n\
             @compute @workgroup_size({wx}, {wy})\n\
             fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{\n\
             let m = info[0];\n\
             let k = info[1];\n\
             let n = info[2];\n\
             let a_off = wg.z * m * k;\n\
             let b_off = select(0u, wg.z * k * n, info[3] == 1u);\n\
             let o_off = wg.z * m * n;\n\
             let row0 = wg.y * {bm}u;\n\
             let col0 = wg.x * {bn}u;\n\
             let tid = lid.y * {wx}u + lid.x;",
            a_len = bk * bm,
            b_len = bk * bn / tn,
            wy = self.wy,
        );
        for i in 0..tm {
            let _ = writeln!(s, "var acc{i} = {acc}(0.0);");
        }
        let b_store = if tn == 4 {
            format!("b_tile[br * {}u + bc / 4u][bc % 4u] = bv;", bn / 4)
        } else {
            format!("b_tile[br * {bn}u + bc] = bv;")
        };
        let _ = writeln!(
            s,
            "for (var k0 = 0u; k0 < k; k0 = k0 + {bk}u) {{\n\
             for (var l = 0u; l < {a_loads}u; l = l + 1u) {{\n\
             let e = tid + l * {threads}u;\n\
             let ar = e / {bk}u;\n\
             let ac = e % {bk}u;\n\
             var av = 0.0;\n\
             if (row0 + ar < m && k0 + ac < k) {{ av = a[a_off + (row0 + ar) * k + k0 + ac]; }}\n\
             a_tile[ac * {bm}u + ar] = av;\n\
             }}\n\
             for (var l = 0u; l < {b_loads}u; l = l + 1u) {{\n\
             let e = tid + l * {threads}u;\n\
             let br = e / {bn}u;\n\
             let bc = e % {bn}u;\n\
             var bv = 0.0;\n\
             if (k0 + br < k && col0 + bc < n) {{ bv = b[b_off + (k0 + br) * n + col0 + bc]; }}\n\
             {b_store}\n\
             }}\n\
             workgroupBarrier();\n\
             for (var kk = 0u; kk < {bk}u; kk = kk + 1u) {{\n\
             let bv = b_tile[kk * {b_row}u + lid.x];\n\
             let ai = kk * {bm}u + lid.y * {tm}u;",
            a_loads = bm * bk / threads,
            b_loads = bk * bn / threads,
            b_row = bn / tn,
        );
        for i in 0..tm {
            let _ = writeln!(s, "acc{i} = acc{i} + a_tile[ai + {i}u] * bv;");
        }
        let _ = writeln!(
            s,
            "}}\nworkgroupBarrier();\n}}\n\
             let r = row0 + lid.y * {tm}u;\n\
             let c = col0 + lid.x * {tn}u;"
        );
        self.store(s);
    }

    /// Each invocation reads its rows of `a` and columns of `b` straight from
    /// the buffers; rows and columns past the edge read the last one (their
    /// results are not stored), so the loop has no branch.
    fn direct_body(&self, s: &mut String, acc: &str) {
        let (tm, tn) = (self.tm, self.tn);
        let _ = writeln!(
            s,
            "@compute @workgroup_size({wx}, {wy})\n\
             fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{\n\
             let m = info[0];\n\
             let k = info[1];\n\
             let n = info[2];\n\
             let r = gid.y * {tm}u;\n\
             let c = gid.x * {tn}u;\n\
             if (r >= m || c >= n) {{ return; }}\n\
             let a_off = gid.z * m * k;\n\
             let b_off = select(0u, gid.z * k * n, info[3] == 1u);\n\
             let o_off = gid.z * m * n;",
            wx = self.wx,
            wy = self.wy,
        );
        for i in 0..tm {
            let _ = writeln!(
                s,
                "let a{i} = a_off + min(r + {i}u, m - 1u) * k;\nvar acc{i} = {acc}(0.0);"
            );
        }
        for j in 1..tn {
            let _ = writeln!(s, "let c{j} = min(c + {j}u, n - 1u);");
        }
        let b_load = if tn == 4 {
            "vec4<f32>(b[br + c], b[br + c1], b[br + c2], b[br + c3])"
        } else {
            "b[br + c]"
        };
        let _ = writeln!(
            s,
            "for (var kk = 0u; kk < k; kk = kk + 1u) {{\n\
             let br = b_off + kk * n;\n\
             let bv = {b_load};"
        );
        for i in 0..tm {
            let _ = writeln!(s, "acc{i} = acc{i} + a[a{i} + kk] * bv;");
        }
        let _ = writeln!(s, "}}");
        self.store(s);
    }

    /// A direct variant over vec4 bindings: an invocation reads 4 rows of `b`
    /// as 4 vectors and each of its rows of `a` as one vector per step of 4
    /// along k, and stores each output row of its block as one vector (k and n
    /// are multiples of 4, so no block is partial along n).
    fn vector_body(&self, s: &mut String) {
        let (tm, w) = (self.tm, self.tn / 4);
        let _ = writeln!(
            s,
            "// matmul variant {name}: generated by src/tensor/matmul_kernels.rs.\n\
             @group(0) @binding(0) var<storage, read> a: array<vec4<f32>>;\n\
             @group(0) @binding(1) var<storage, read> b: array<vec4<f32>>;\n\
             @group(0) @binding(2) var<storage, read_write> out: array<vec4<f32>>;\n\
             @group(0) @binding(3) var<storage, read> info: array<u32>;\n\
             @compute @workgroup_size({wx}, {wy})\n\
             fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{\n\
             let m = info[0];\n\
             let k4 = info[1] / 4u;\n\
             let n4 = info[2] / 4u;\n\
             let r = gid.y * {tm}u;\n\
             let c4 = gid.x * {w}u;\n\
             if (r >= m || c4 >= n4) {{ return; }}\n\
             let a_off = gid.z * m * k4;\n\
             let b_off = select(0u, gid.z * k4 * 4u * n4, info[3] == 1u);\n\
             let o_off = gid.z * m * n4;",
            name = self.name,
            wx = self.wx,
            wy = self.wy,
        );
        // Columns of the block past the end of the row repeat the last one
        // (read, never stored).
        for j in 0..w {
            let _ = writeln!(s, "let col{j} = min(c4 + {j}u, n4 - 1u);");
        }
        for i in 0..tm {
            let _ = writeln!(s, "let a{i} = a_off + min(r + {i}u, m - 1u) * k4;");
            for j in 0..w {
                let _ = writeln!(s, "var acc{i}_{j} = vec4<f32>(0.0);");
            }
        }
        let _ = writeln!(
            s,
            "for (var q = 0u; q < k4; q = q + 1u) {{\n\
             let br = b_off + q * 4u * n4;"
        );
        for j in 0..w {
            for d in 0..4 {
                let _ = writeln!(s, "let b{d}_{j} = b[br + {d}u * n4 + col{j}];");
            }
        }
        for i in 0..tm {
            let _ = writeln!(s, "let v{i} = a[a{i} + q];");
            for j in 0..w {
                let _ = writeln!(
                    s,
                    "acc{i}_{j} = acc{i}_{j} + v{i}.x * b0_{j} + v{i}.y * b1_{j} + v{i}.z * b2_{j} + v{i}.w * b3_{j};"
                );
            }
        }
        let _ = writeln!(s, "}}");
        for i in 0..tm {
            let _ = writeln!(s, "if (r + {i}u < m) {{");
            for j in 0..w {
                let _ = writeln!(
                    s,
                    "if (c4 + {j}u < n4) {{ out[o_off + (r + {i}u) * n4 + c4 + {j}u] = acc{i}_{j}; }}"
                );
            }
            let _ = writeln!(s, "}}");
        }
        let _ = writeln!(s, "}}");
    }

    /// Stores the block at row `r`, column `c`, within the output.
    fn store(&self, s: &mut String) {
        for i in 0..self.tm {
            let _ = writeln!(
                s,
                "if (r + {i}u < m) {{\nlet o{i} = o_off + (r + {i}u) * n + c;"
            );
            if self.tn == 4 {
                let _ = writeln!(
                    s,
                    "if (c + 3u < n) {{\n\
                     out[o{i}] = acc{i}.x;\nout[o{i} + 1u] = acc{i}.y;\n\
                     out[o{i} + 2u] = acc{i}.z;\nout[o{i} + 3u] = acc{i}.w;\n\
                     }} else {{\n\
                     for (var j = 0u; j < 4u; j = j + 1u) {{ if (c + j < n) {{ out[o{i} + j] = acc{i}[j]; }} }}\n\
                     }}"
                );
            } else {
                let _ = writeln!(s, "if (c < n) {{ out[o{i}] = acc{i}; }}");
            }
            let _ = writeln!(s, "}}");
        }
        let _ = writeln!(s, "}}");
    }
}

/// The matmul as the device compiles it: the specialization is the variant's
/// name.
pub(crate) fn source() -> KernelSource {
    KernelSource {
        name: NAME,
        template: "",
        specialize: generate,
    }
}

/// An unknown name gives an empty source, which fails to compile with an
/// error (names are checked where they come in).
fn generate(_template: &'static str, spec: &str) -> String {
    find(spec).map(Variant::wgsl).unwrap_or_default()
}

/// The variant for a `m x k x n` product on `gpu`: the pinned one, the one
/// tuned for its shape class (in this process or the cache file), or, the
/// first time a class is seen, the fastest on a trial problem, timed here on
/// the worker running the node (the frontend does not wait). `bindings` are
/// the real operands and output: trials write scratch results into the
/// output, which the real dispatch then overwrites.
pub(crate) fn choose(
    gpu: &Gpu,
    (m, k, n): (usize, usize, usize),
    bindings: &[(&GpuBuffer, Access)],
) -> Result<&'static Variant, String> {
    let default = default_for(gpu, k, n);
    // A vec4 variant cannot compute a product whose k or n is not a multiple
    // of 4: the default (not vec4 then) does.
    if let Some(pinned) = gpu.autotune.pinned(NAME) {
        return find(pinned)
            .map(|v| v.for_shape(k, n, default))
            .ok_or_else(|| format!("no matmul kernel is named {pinned:?}"));
    }
    if !gpu.autotune.on || m * k * n < TUNE_MIN {
        return Ok(default);
    }
    // The vec4 variants run in the trials only when k and n are multiples
    // of 4; one chosen for such a product stands for its whole class, and a
    // product of the class that is not aligned takes the default.
    let class = matmul_class(m, k, n);
    let known = || tune::lookup(&gpu.autotune, &gpu.adapter, &source(), &class);
    if let Some(v) = known().as_deref().and_then(find) {
        return Ok(v.for_shape(k, n, default));
    }
    let _tuning = tune::exclusive();
    // Another device of the same adapter may have tuned the class meanwhile.
    if let Some(v) = known().as_deref().and_then(find) {
        return Ok(v.for_shape(k, n, default));
    }
    let (tm, tk) = trial(m, k, n);
    let info = [tm as u32, tk as u32, n as u32, 0];
    let mut timings = Vec::new();
    for v in VARIANTS
        .iter()
        .filter(|v| v.usable(tk, n) && v.usable(k, n))
    {
        // A variant the adapter cannot run (too much workgroup memory, say)
        // drops out; a lost device ends the tuning.
        match gpu.time_dispatch(source(), v.name, bindings, &info, v.grid(1, tm, n), 2) {
            Ok(t) => timings.push((v.name.to_string(), t)),
            Err(e) => gpu.check_lost().map_err(|_| e)?,
        }
    }
    let Some(best) = timings
        .iter()
        .min_by_key(|(_, t)| *t)
        .and_then(|(name, _)| find(name))
    else {
        return Ok(default);
    };
    tune::store(
        &gpu.autotune,
        &gpu.adapter,
        &source(),
        &class,
        best.name,
        timings,
    );
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_tiles_divide_among_invocations() {
        let mut names = matmul_kernels();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), VARIANTS.len());
        for v in VARIANTS {
            assert!(
                v.tn == 1 || v.tn == 4 || (v.v4 && v.tn % 4 == 0),
                "{}",
                v.name
            );
            assert_eq!(v.v4, v.name.ends_with("v4"), "{}", v.name);
            assert!(!v.v4 || v.bk == 0, "{}", v.name);
            assert!(v.wx * v.wy <= 256, "{}", v.name);
            if v.bk > 0 {
                let threads = v.wx * v.wy;
                assert_eq!(v.rows() * v.bk % threads, 0, "{}", v.name);
                assert_eq!(v.cols() * v.bk % threads, 0, "{}", v.name);
            }
        }
    }

    #[test]
    fn classes_round_each_size_up_to_a_power_of_four() {
        assert_eq!(matmul_class(1, 16, 17), "m16.k16.n64");
        assert_eq!(matmul_class(1024, 1000, 4097), "m1024.k1024.nbig");
    }

    #[test]
    fn a_trial_stays_within_the_problem_and_near_its_budget() {
        for (m, k, n) in [
            (1024, 1024, 1024),
            (4096, 4096, 4096),
            (100, 9, 30000),
            (64, 64, 64),
        ] {
            let (tm, tk) = trial(m, k, n);
            assert!(tm <= m && tk <= k && tm > 0 && tk > 0, "{m} {k} {n}");
            assert!(tm >= m.min(128) && tk >= k.min(64), "{m} {k} {n}");
            assert!(
                tm * tk * n <= 2 * TRIAL_BUDGET || tm == m.min(128),
                "{m} {k} {n}"
            );
        }
        assert_eq!(trial(1024, 1024, 1024), (256, 64));
    }
}
