// binary.wgsl: out[i] = OP(a[ia], b[ib]) with numpy broadcasting.
//
// Bindings (group 0):
//   0: a     array<f32>, read
//   1: b     array<f32>, read
//   2: out   array<f32>, read_write
//   3: info  array<u32>, read: [n, rank, out_dims[rank], a_strides[rank], b_strides[rank]]
//      (a broadcast dimension has stride 0)
// Workgroup size: 256. Grid: ceil(n / 256) workgroups, folded into (x, y) when
// above the 65,535 limit of one dimension.
// Specialization: `OP` is replaced by an expression in `x` and `y`.

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> info: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 256u;
    let n = info[0];
    if (i >= n) {
        return;
    }
    let rank = info[1];
    var rest = i;
    var ia = 0u;
    var ib = 0u;
    var d = rank;
    loop {
        if (d == 0u) {
            break;
        }
        d = d - 1u;
        let dim = info[2u + d];
        let idx = rest % dim;
        rest = rest / dim;
        ia = ia + idx * info[2u + rank + d];
        ib = ib + idx * info[2u + 2u * rank + d];
    }
    let x = a[ia];
    let y = b[ib];
    out[i] = OP;
}
