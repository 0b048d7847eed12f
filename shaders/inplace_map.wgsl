// inplace_map.wgsl: a[i] = OP(a[i], s), in place.
//
// Bindings (group 0):
//   0: a     array<f32>, read_write
//   1: info  array<u32>, read: [n, bits of the scalar s as f32]
// Workgroup size: 256. Grid: ceil(n / 256) workgroups, folded into (x, y) when
// above the 65,535 limit of one dimension.
// Specialization: `OP` is replaced by an expression in `x` (a[i]) and `s`.

@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@group(0) @binding(1) var<storage, read> info: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 256u;
    let n = info[0];
    if (i >= n) {
        return;
    }
    let s = bitcast<f32>(info[1]);
    let x = a[i];
    a[i] = OP;
}
