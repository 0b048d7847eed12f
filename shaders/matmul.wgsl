// matmul.wgsl: out[z] = a[z] @ b[z or 0], row-major f32, any sizes.
//
// Bindings (group 0):
//   0: a     array<f32>, read: batch x m x k
//   1: b     array<f32>, read: batch x k x n, or one k x n shared by every batch entry
//   2: out   array<f32>, read_write: batch x m x n
//   3: info  array<u32>, read: [m, k, n, b_batched (0 or 1)]
// Workgroup size: 16 x 16. Grid: (ceil(n / 64), ceil(m / 64), batch).
// Tiling: each workgroup computes a 64 x 64 tile of the output, stepping through
// k in slices of 16 staged in workgroup memory; each invocation accumulates a
// 4 x 4 block in registers (four vec4 rows), reading the staged slices as vec4.

const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 16u;

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> info: array<u32>;

// a_tile[kk * 16 + r4] holds rows 4 * r4 .. 4 * r4 + 3 of column kk of the A slice.
var<workgroup> a_tile: array<vec4<f32>, 256>;
// b_tile[kk * 16 + c4] holds columns 4 * c4 .. 4 * c4 + 3 of row kk of the B slice.
var<workgroup> b_tile: array<vec4<f32>, 256>;

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let m = info[0];
    let k = info[1];
    let n = info[2];
    let a_off = wg.z * m * k;
    let b_off = select(0u, wg.z * k * n, info[3] == 1u);
    let o_off = wg.z * m * n;
    let row0 = wg.y * BM;
    let col0 = wg.x * BN;
    let tid = lid.y * 16u + lid.x;

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);

    let slices = (k + BK - 1u) / BK;
    for (var s = 0u; s < slices; s = s + 1u) {
        let k0 = s * BK;
        // Stage a 64 x 16 slice of A and a 16 x 64 slice of B: 4 floats each per
        // invocation, zero outside the matrices.
        for (var l = 0u; l < 4u; l = l + 1u) {
            let e = tid + l * 256u;
            let ar = e / BK;
            let ac = e % BK;
            var av = 0.0;
            if (row0 + ar < m && k0 + ac < k) {
                av = a[a_off + (row0 + ar) * k + k0 + ac];
            }
            a_tile[ac * 16u + ar / 4u][ar % 4u] = av;
            let br = e / BN;
            let bc = e % BN;
            var bv = 0.0;
            if (k0 + br < k && col0 + bc < n) {
                bv = b[b_off + (k0 + br) * n + col0 + bc];
            }
            b_tile[br * 16u + bc / 4u][bc % 4u] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk = kk + 1u) {
            let av = a_tile[kk * 16u + lid.y];
            let bv = b_tile[kk * 16u + lid.x];
            acc0 = acc0 + av.x * bv;
            acc1 = acc1 + av.y * bv;
            acc2 = acc2 + av.z * bv;
            acc3 = acc3 + av.w * bv;
        }
        workgroupBarrier();
    }

    let r = row0 + lid.y * 4u;
    let c = col0 + lid.x * 4u;
    var rows = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var i = 0u; i < 4u; i = i + 1u) {
        if (r + i < m) {
            for (var j = 0u; j < 4u; j = j + 1u) {
                if (c + j < n) {
                    out[o_off + (r + i) * n + c + j] = rows[i][j];
                }
            }
        }
    }
}
