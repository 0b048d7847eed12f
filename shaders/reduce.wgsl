// reduce.wgsl: out[o * inner + j] = REDUCE over r of a[(o * len + r) * inner + j].
//
// The input is viewed as [outer, len, inner]; the output is [outer, inner]. A
// reduction over everything is outer = inner = 1.
// Bindings (group 0):
//   0: a     array<f32>, read
//   1: out   array<f32>, read_write
//   2: info  array<u32>, read: [outputs, len, inner]
// Workgroup size: 256. One workgroup per output element (folded into (x, y) when
// above 65,535): each invocation folds a strided part of the row, then the
// workgroup combines the 256 partial results in shared memory.
// Specialization: `KIND` is 0 sum, 1 mean, 2 max, 3 min, 4 argmax (index as f32).
// max, min and argmax propagate NaN (argmax reports the first NaN); ties in
// argmax go to the lowest index.

const KIND: u32 = KIND_VALUE;

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> info: array<u32>;

var<workgroup> vals: array<f32, 256>;
var<workgroup> idxs: array<u32, 256>;

// By its bits: shader compilers may assume `x != x` is false.
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// Whether (b, ib) replaces (a, ia) as the running result of max / min / argmax.
fn wins(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    if (is_nan(a)) {
        return is_nan(b) && ib < ia;
    }
    if (is_nan(b)) {
        return true;
    }
    if (KIND == 3u) {
        return b < a || (b == a && ib < ia);
    }
    return b > a || (b == a && ib < ia);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let o = wg.x + wg.y * groups.x;
    let outputs = info[0];
    let len = info[1];
    let inner = info[2];
    if (o >= outputs) {
        return;
    }
    let base = (o / inner) * len * inner + o % inner;
    var acc = 0.0;
    var best = 0u;
    var first = true;
    for (var r = lid; r < len; r = r + 256u) {
        let x = a[base + r * inner];
        if (KIND <= 1u) {
            acc = acc + x;
        } else if (first || wins(acc, best, x, r)) {
            acc = x;
            best = r;
        }
        first = false;
    }
    // An invocation that saw nothing holds a neutral value: 0 for sums, and an
    // index past the end, which never wins a tie-free comparison below.
    if (first && KIND > 1u) {
        best = 0xffffffffu;
    }
    vals[lid] = acc;
    idxs[lid] = best;
    workgroupBarrier();
    for (var step = 128u; step > 0u; step = step / 2u) {
        if (lid < step) {
            let other = lid + step;
            if (KIND <= 1u) {
                vals[lid] = vals[lid] + vals[other];
            } else if (idxs[other] != 0xffffffffu
                && (idxs[lid] == 0xffffffffu || wins(vals[lid], idxs[lid], vals[other], idxs[other]))) {
                vals[lid] = vals[other];
                idxs[lid] = idxs[other];
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        var result = vals[0];
        if (KIND == 1u) {
            result = result / f32(len);
        } else if (KIND == 4u) {
            result = f32(idxs[0]);
        }
        if (KIND != 0u && len == 0u) {
            // No elements: the mean is NaN (max, min and argmax of nothing are
            // rejected when recorded). Built from `len` at run time, since a
            // NaN constant is a shader-creation error.
            result = bitcast<f32>(len | 0x7fc00000u);
        }
        out[o] = result;
    }
}
