// pool.wgsl: 2-D average and max pooling, and their gradients.
//
// x is [n, c, h, w]; a (kh, kw) window slides with stride (sh, sw) over x
// padded by (ph, pw) on each side; out and gout are [n, c, oh, ow]. Average
// pooling divides the window's sum by kh * kw (the padding counts as zeros);
// max pooling takes the largest in-bounds element, NaN if one is NaN (callers
// guarantee ph < kh and pw < kw, so every window holds an element of x).
// Bindings (group 0):
//   forward (kinds 0, 1):
//     0: x     array<f32>, read
//     1: out   array<f32>, read_write
//     2: info  array<u32>, read
//   backward (kinds 2, 3):
//     0: x     array<f32>, read
//     1: gout  array<f32>, read
//     2: gx    array<f32>, read_write
//     3: info  array<u32>, read
//   info is [n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow].
// Workgroup size: 256. One invocation per element of out (forward) or gx
// (backward), which gathers what it needs (no atomics): ceil(len / 256)
// workgroups, folded into (x, y) when above the 65,535 limit of one dimension.
// Specialization: `KIND` is 0 average, 1 max, 2 average backward, 3 max
// backward. A gx position sums, over the windows containing it in row-major
// order (as the CPU kernel adds them), gout / (kh * kw) (average) or gout
// where it is the window's first maximum (max: the first NaN, else the first
// of the largest values, row-major within the window).
//
// The pipeline's bind group layout comes from the bindings its entry point
// uses, so each kind must use exactly its own: `main` calls `run_KIND_VALUE`,
// which reaches only that kind's variables, and the binding numbers depend on
// KIND so that no two variables share one. `out` and `gx` are one variable,
// `dst`.

const KIND: u32 = KIND_VALUE;
const BACKWARD: u32 = KIND / 2u;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1u + BACKWARD) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2u + BACKWARD) var<storage, read> info: array<u32>;
@group(0) @binding(3u - 2u * BACKWARD) var<storage, read> gout: array<f32>;

// By its bits: shader compilers may assume `x != x` is false.
fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

struct Window {
    n: u32,
    c: u32,
    h: u32,
    w: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    ph: u32,
    pw: u32,
    oh: u32,
    ow: u32,
}

fn window() -> Window {
    return Window(
        info[0], info[1], info[2], info[3], info[4], info[5],
        info[6], info[7], info[8], info[9], info[10], info[11],
    );
}

// The sum of the in-bounds elements of window (oy, ox) of the plane starting
// at x[base], row-major.
fn window_sum(g: Window, base: u32, oy: u32, ox: u32) -> f32 {
    var sum = 0.0;
    for (var ky = 0u; ky < g.kh; ky = ky + 1u) {
        let py = oy * g.sh + ky;
        if (py < g.ph || py >= g.ph + g.h) {
            continue;
        }
        for (var kx = 0u; kx < g.kw; kx = kx + 1u) {
            let px = ox * g.sw + kx;
            if (px >= g.pw && px < g.pw + g.w) {
                sum = sum + x[base + (py - g.ph) * g.w + px - g.pw];
            }
        }
    }
    return sum;
}

// The index in x of the first maximum of window (oy, ox) of the plane starting
// at x[base]: the first NaN, else the first of the largest values.
fn window_argmax(g: Window, base: u32, oy: u32, ox: u32) -> u32 {
    var best = 0xffffffffu;
    var best_v = 0.0;
    for (var ky = 0u; ky < g.kh; ky = ky + 1u) {
        let py = oy * g.sh + ky;
        if (py < g.ph || py >= g.ph + g.h) {
            continue;
        }
        for (var kx = 0u; kx < g.kw; kx = kx + 1u) {
            let px = ox * g.sw + kx;
            if (px < g.pw || px >= g.pw + g.w) {
                continue;
            }
            let j = base + (py - g.ph) * g.w + px - g.pw;
            let v = x[j];
            if (is_nan(v)) {
                return j;
            }
            if (best == 0xffffffffu || v > best_v) {
                best = j;
                best_v = v;
            }
        }
    }
    return best;
}

fn forward(i: u32) {
    let g = window();
    if (i >= g.n * g.c * g.oh * g.ow) {
        return;
    }
    let ox = i % g.ow;
    let oy = (i / g.ow) % g.oh;
    let base = i / (g.ow * g.oh) * g.h * g.w;
    if (KIND == 0u) {
        dst[i] = window_sum(g, base, oy, ox) / f32(g.kh * g.kw);
    } else {
        dst[i] = x[window_argmax(g, base, oy, ox)];
    }
}

fn backward(i: u32) {
    let g = window();
    if (i >= g.n * g.c * g.h * g.w) {
        return;
    }
    let px = i % g.w + g.pw;
    let py = (i / g.w) % g.h + g.ph;
    let plane = i / (g.w * g.h);
    let base = plane * g.h * g.w;
    // The windows covering padded (py, px): oy * sh <= py < oy * sh + kh,
    // that is oy in [ceil((py + 1 - kh) / sh), py / sh], within [0, oh).
    var oy0 = 0u;
    if (py + g.sh > g.kh) {
        oy0 = (py + g.sh - g.kh) / g.sh;
    }
    var ox0 = 0u;
    if (px + g.sw > g.kw) {
        ox0 = (px + g.sw - g.kw) / g.sw;
    }
    let oy1 = min(py / g.sh + 1u, g.oh);
    let ox1 = min(px / g.sw + 1u, g.ow);
    let area = f32(g.kh * g.kw);
    var acc = 0.0;
    for (var oy = oy0; oy < oy1; oy = oy + 1u) {
        for (var ox = ox0; ox < ox1; ox = ox + 1u) {
            let o = (plane * g.oh + oy) * g.ow + ox;
            if (KIND == 2u) {
                acc = acc + gout[o] / area;
            } else if (window_argmax(g, base, oy, ox) == i) {
                acc = acc + gout[o];
            }
        }
    }
    dst[i] = acc;
}

fn run_0(i: u32) {
    forward(i);
}

fn run_1(i: u32) {
    forward(i);
}

fn run_2(i: u32) {
    backward(i);
}

fn run_3(i: u32) {
    backward(i);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 256u;
    run_KIND_VALUE(i);
}
