// im2col.wgsl: unfolds a convolution's input into one row per output position
// (im2col), or folds such rows back, summing overlaps (col2im, its adjoint).
//
// x is [n, c, h, w]; a (kh, kw) kernel slides with stride (sh, sw) over x
// padded by (ph, pw) zeros on each side, giving oh * ow positions. cols is
// [n, oh * ow, ckk] with ckk = c * kh * kw:
//   cols[(b * oh * ow + oy * ow + ox) * ckk + (ci * kh + ky) * kw + kx]
//     = x[b, ci, oy * sh + ky - ph, ox * sw + kx - pw], or 0 in the padding.
// Bindings (group 0):
//   0: src   array<f32>, read: x (im2col) or cols (col2im)
//   1: dst   array<f32>, read_write: cols (im2col) or x (col2im)
//   2: info  array<u32>, read: [n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow]
// Workgroup size: 256. One invocation per element of dst, which gathers what
// it needs (no atomics): ceil(len(dst) / 256) workgroups, folded into (x, y)
// when above the 65,535 limit of one dimension.
// Specialization: `KIND` is 0 im2col, 1 col2im. col2im adds the entries of one
// x position in the order of their output positions, as the CPU kernel does.

const KIND: u32 = KIND_VALUE;

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> info: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 256u;
    let n = info[0];
    let c = info[1];
    let h = info[2];
    let w = info[3];
    let kh = info[4];
    let kw = info[5];
    let sh = info[6];
    let sw = info[7];
    let ph = info[8];
    let pw = info[9];
    let oh = info[10];
    let ow = info[11];
    let ckk = c * kh * kw;
    if (KIND == 0u) {
        if (i >= n * oh * ow * ckk) {
            return;
        }
        let col = i % ckk;
        let row = i / ckk;
        let kx = col % kw;
        let ky = (col / kw) % kh;
        let ci = col / (kw * kh);
        let ox = row % ow;
        let oy = (row / ow) % oh;
        let b = row / (ow * oh);
        // Coordinates in the padded input, where x starts at (ph, pw).
        let py = oy * sh + ky;
        let px = ox * sw + kx;
        var v = 0.0;
        if (py >= ph && py < ph + h && px >= pw && px < pw + w) {
            v = src[((b * c + ci) * h + py - ph) * w + px - pw];
        }
        dst[i] = v;
    } else {
        if (i >= n * c * h * w) {
            return;
        }
        let px = i % w + pw;
        let py = (i / w) % h + ph;
        let plane = i / (w * h);
        let ci = plane % c;
        let b = plane / c;
        // The windows covering padded (py, px): oy * sh <= py < oy * sh + kh,
        // that is oy in [ceil((py + 1 - kh) / sh), py / sh], within [0, oh).
        var oy0 = 0u;
        if (py + sh > kh) {
            oy0 = (py + sh - kh) / sh;
        }
        var ox0 = 0u;
        if (px + sw > kw) {
            ox0 = (px + sw - kw) / sw;
        }
        let oy1 = min(py / sh + 1u, oh);
        let ox1 = min(px / sw + 1u, ow);
        var acc = 0.0;
        for (var oy = oy0; oy < oy1; oy = oy + 1u) {
            let ky = py - oy * sh;
            for (var ox = ox0; ox < ox1; ox = ox + 1u) {
                let kx = px - ox * sw;
                acc = acc + src[((b * oh + oy) * ow + ox) * ckk + (ci * kh + ky) * kw + kx];
            }
        }
        dst[i] = acc;
    }
}
