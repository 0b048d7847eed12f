// strided_copy.wgsl: out[dst(i)] = a[src(i)] for i in 0..n, where i is unraveled
// over `dims` (row-major) and each side adds index * stride per dimension to its
// base offset. Covers transpose, broadcast (stride 0), narrow / split (a base
// offset) and concat (one copy per input into its slice of the output).
//
// Bindings (group 0):
//   0: a     array<f32>, read
//   1: out   array<f32>, read_write
//   2: info  array<u32>, read: [n, rank, src_base, dst_base, dims[rank],
//            src_strides[rank], dst_strides[rank]]
// Workgroup size: 256. Grid: ceil(n / 256) workgroups, folded into (x, y) when
// above the 65,535 limit of one dimension.

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> info: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 256u;
    let n = info[0];
    if (i >= n) {
        return;
    }
    let rank = info[1];
    var src = info[2];
    var dst = info[3];
    var rest = i;
    var d = rank;
    loop {
        if (d == 0u) {
            break;
        }
        d = d - 1u;
        let dim = info[4u + d];
        let idx = rest % dim;
        rest = rest / dim;
        src = src + idx * info[4u + rank + d];
        dst = dst + idx * info[4u + 2u * rank + d];
    }
    out[dst] = a[src];
}
