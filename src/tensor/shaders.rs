//! The op kernels in `shaders/` (one per file): their sources, how each is
//! specialized, and which of its bindings it writes. The device sees them only
//! as [`KernelSource`]s.

use crate::device::gpu::{Access, Gpu, GpuBuffer, Grid, KernelSource};
use smallvec::SmallVec;

/// The kernels in `shaders/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// `binary.wgsl`: `OP` in `x` and `y`, with broadcasting.
    Binary,
    /// `map.wgsl`: `OP` in `x` and the scalar `s`.
    Map,
    /// `inplace.wgsl`: `a = OP(x, y)` with `y` broadcast.
    Inplace,
    /// `inplace_map.wgsl`: `a = OP(x, s)`.
    InplaceMap,
    /// `reduce.wgsl`: specialized by the reduction kind (0 to 4).
    Reduce,
    /// `strided_copy.wgsl`: layout changes.
    StridedCopy,
    /// The matrix product, batched: one of the variants of
    /// `matmul_kernels.rs`, named by the specialization.
    Matmul,
    /// `im2col.wgsl`: specialized by the direction (0 im2col, 1 col2im).
    Im2col,
    /// `pool.wgsl`: specialized by the kind (0 average, 1 max, 2 and 3 their
    /// gradients).
    Pool,
}

/// The expression that replaces `OP`.
fn replace_op(template: &'static str, spec: &str) -> String {
    template.replace("OP;", &format!("{spec};"))
}

/// The value of `KIND_VALUE`.
fn replace_kind(template: &'static str, spec: &str) -> String {
    template.replace("KIND_VALUE", spec)
}

/// No specialization.
fn unspecialized(template: &'static str, _spec: &str) -> String {
    template.to_string()
}

impl Kernel {
    /// Every kernel, for the shader validation test.
    #[cfg(test)]
    pub(crate) const ALL: [Kernel; 9] = [
        Kernel::Binary,
        Kernel::Map,
        Kernel::Inplace,
        Kernel::InplaceMap,
        Kernel::Reduce,
        Kernel::StridedCopy,
        Kernel::Matmul,
        Kernel::Im2col,
        Kernel::Pool,
    ];

    /// The kernel as the device compiles it.
    pub(crate) fn source(self) -> KernelSource {
        let (name, template, specialize): (_, _, fn(&'static str, &str) -> String) = match self {
            Kernel::Binary => (
                "binary",
                include_str!("../../shaders/binary.wgsl"),
                replace_op,
            ),
            Kernel::Map => ("map", include_str!("../../shaders/map.wgsl"), replace_op),
            Kernel::Inplace => (
                "inplace",
                include_str!("../../shaders/inplace.wgsl"),
                replace_op,
            ),
            Kernel::InplaceMap => (
                "inplace_map",
                include_str!("../../shaders/inplace_map.wgsl"),
                replace_op,
            ),
            Kernel::Reduce => (
                "reduce",
                include_str!("../../shaders/reduce.wgsl"),
                replace_kind,
            ),
            Kernel::StridedCopy => (
                "strided_copy",
                include_str!("../../shaders/strided_copy.wgsl"),
                unspecialized,
            ),
            Kernel::Matmul => return super::matmul_kernels::source(),
            Kernel::Im2col => (
                "im2col",
                include_str!("../../shaders/im2col.wgsl"),
                replace_kind,
            ),
            Kernel::Pool => (
                "pool",
                include_str!("../../shaders/pool.wgsl"),
                replace_kind,
            ),
        };
        KernelSource {
            name,
            template,
            specialize,
        }
    }

    /// The kernel's source with its specialization filled in: the expression
    /// that replaces `OP`, or the value of `KIND_VALUE`; kernels without one
    /// ignore it.
    #[cfg(test)]
    pub(crate) fn specialize(self, spec: &str) -> String {
        self.source().wgsl(spec)
    }

    /// How the kernel uses each of its `n` bindings: the in-place ones write
    /// their first, the others their last. `inplace_map.wgsl` specialized to
    /// `s` (`fill_`) does not read what it writes.
    fn access(self, spec: &str, n: usize) -> impl Iterator<Item = Access> {
        let (written, access) = match self {
            Kernel::InplaceMap if spec == "s" => (0, Access::Overwrite),
            Kernel::Inplace | Kernel::InplaceMap => (0, Access::Write),
            _ => (n.saturating_sub(1), Access::Write),
        };
        (0..n).map(move |i| if i == written { access } else { Access::Read })
    }

    /// Encodes the kernel on `gpu` (after its deferred work). `buffers` are
    /// bound in order and `info` is uploaded as the last binding.
    pub(crate) fn dispatch(
        self,
        gpu: &Gpu,
        spec: &str,
        buffers: &[&GpuBuffer],
        info: &[u32],
        grid: Grid,
    ) -> Result<(), String> {
        gpu.dispatch(
            self.source(),
            spec,
            &self.bindings(spec, buffers),
            info,
            grid,
        )
    }

    /// `buffers` with how the kernel uses each.
    pub(crate) fn bindings<'b>(
        self,
        spec: &str,
        buffers: &[&'b GpuBuffer],
    ) -> SmallVec<[(&'b GpuBuffer, Access); 4]> {
        buffers
            .iter()
            .copied()
            .zip(self.access(spec, buffers.len()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_kernels_write_their_output_binding() {
        let access = |k: Kernel, spec: &str, n| k.access(spec, n).collect::<Vec<_>>();
        use Access::*;
        assert_eq!(access(Kernel::Binary, "x + y", 3), [Read, Read, Write]);
        assert_eq!(access(Kernel::Inplace, "x + y", 2), [Write, Read]);
        assert_eq!(access(Kernel::InplaceMap, "x * s", 1), [Write]);
        assert_eq!(access(Kernel::InplaceMap, "s", 1), [Overwrite]);
    }

    #[test]
    fn kernel_names_are_unique() {
        let mut names: Vec<_> = Kernel::ALL.iter().map(|k| k.source().name).collect();
        names.push(KernelSource::WHOLE.name);
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Kernel::ALL.len() + 1);
    }
}
