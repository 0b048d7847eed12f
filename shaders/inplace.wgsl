// inplace.wgsl: a[i] = OP(a[i], b[ib]) with b broadcast to a's shape.
//
// Bindings (group 0):
//   0: a     array<f32>, read_write
//   1: b     array<f32>, read
//   2: info  array<u32>, read: [n, rank, dims[rank], b_strides[rank]]
//      (a broadcast dimension has stride 0)
// Workgroup size: 256. Grid: ceil(n / 256) workgroups, folded into (x, y) when
// above the 65,535 limit of one dimension.
// Specialization: `OP` is replaced by an expression in `x` (a[i]) and `y` (b[ib]).

@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read> info: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 256u;
    let n = info[0];
    if (i >= n) {
        return;
    }
    let rank = info[1];
    var rest = i;
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
        ib = ib + idx * info[2u + rank + d];
    }
    let x = a[i];
    let y = b[ib];
    a[i] = OP;
}
