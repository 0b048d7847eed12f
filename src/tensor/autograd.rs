//! Reverse-mode autodiff: the tape that lives beside the tensors.
//!
//! A tensor that requires a gradient carries a [`Tape`] link: a *leaf* (a
//! parameter, whose gradient accumulates) or an *op node* naming the op, where
//! it was recorded, the tape links of its inputs and a closure that turns the
//! gradient of the op's output into gradients of its inputs. The engine's graph
//! never sees the tape: it only ever holds live work. [`Tensor::backward`] walks
//! the tape in reverse topological order and *records* the gradient ops like any
//! other tensor op, so it returns at once and nothing runs until something
//! demands a gradient.
//!
//! Values an op saves for its gradient are checked when the gradient is
//! recorded: one overwritten in place since (a `Var` version that moved on) is
//! an error, not a silently wrong gradient.

use super::{Shape, Tensor};
use crate::error::{Error, Location, Result};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Turns the gradient of an op's output into gradients of its inputs (`None`
/// for an input that needs none, as told by the flags).
pub(crate) type BackwardFn =
    Box<dyn Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// A tensor's place on the tape.
#[derive(Clone)]
pub(crate) enum Tape {
    /// A tensor that requires a gradient and was not computed from one.
    Leaf(Arc<Leaf>),
    /// The output of an op with at least one input on the tape.
    Op(Arc<OpNode>),
}

/// A leaf's accumulated gradient.
pub(crate) struct Leaf {
    grad: Mutex<Option<Tensor>>,
}

/// One recorded op on the tape.
pub(crate) struct OpNode {
    op: &'static str,
    location: Location,
    inputs: Vec<Option<Tape>>,
    /// `None` once a backward pass has freed it.
    backward: Mutex<Option<BackwardFn>>,
}

thread_local! {
    /// Depth of no-grad scopes on this thread (ops are recorded on the caller's
    /// thread, so the flag is per thread).
    static NO_GRAD: Cell<u32> = const { Cell::new(0) };
}

fn grad_enabled() -> bool {
    NO_GRAD.with(|d| d.get() == 0)
}

/// While alive, ops recorded on this thread keep no tape: their outputs do not
/// require a gradient. Nests.
///
/// ```
/// use lazyflow::{Engine, NoGrad, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let w = Tensor::ones_in(&engine, [2]).requires_grad(true);
/// {
///     let _guard = NoGrad::new();
///     assert!(!(&w * 2.0).tracks_grad());
/// }
/// assert!((&w * 2.0).tracks_grad());
/// ```
pub struct NoGrad {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl NoGrad {
    /// Starts a no-grad scope on this thread.
    #[allow(clippy::new_without_default)]
    pub fn new() -> NoGrad {
        NO_GRAD.with(|d| d.set(d.get() + 1));
        NoGrad {
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for NoGrad {
    fn drop(&mut self) {
        NO_GRAD.with(|d| d.set(d.get() - 1));
    }
}

/// Runs `f` with no tape kept for the ops it records (see [`NoGrad`]): for
/// evaluation and for in-place parameter updates.
///
/// ```
/// use lazyflow::{no_grad, Engine, Tensor};
/// let engine = Engine::builder().workers(1).build().unwrap();
/// let w = Tensor::ones_in(&engine, [2]).requires_grad(true);
/// let y = no_grad(|| &w * 3.0);
/// assert!(!y.tracks_grad());
/// ```
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = NoGrad::new();
    f()
}

/// A value an op keeps for its gradient, with the version it had then.
pub(crate) struct Saved {
    tensor: Tensor,
    version: u64,
    op: &'static str,
    location: Location,
}

impl Saved {
    pub(crate) fn new(t: &Tensor, op: &'static str, location: Location) -> Saved {
        Saved {
            tensor: t.detach(),
            version: t.var.version(),
            op,
            location,
        }
    }

    /// The saved value, or an error if a later op overwrote it in place.
    pub(crate) fn get(&self) -> Result<&Tensor> {
        if self.tensor.var.version() != self.version {
            return Err(Error::InvalidArgument {
                op: "backward",
                shape: self.tensor.shape.to_string(),
                reason: format!(
                    "a value that {} (recorded at {}) saved for its gradient was \
                     modified in place after it was recorded",
                    self.op, self.location
                ),
                location: self.location,
            });
        }
        Ok(&self.tensor)
    }
}

fn key<T>(a: &Arc<T>) -> usize {
    Arc::as_ptr(a) as *const () as usize
}

impl Tensor {
    /// This tensor as a leaf that requires a gradient (`true`), or without any
    /// tape (`false`). It is a new handle to the same data: other handles keep
    /// what they had.
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = Tensor::from_vec_in(&engine, vec![1.0, 2.0, 3.0], [3]).unwrap().requires_grad(true);
    /// let y = (&x * &x).sum(); // sum of squares
    /// y.backward().unwrap();
    /// assert_eq!(x.grad().unwrap().to_vec().unwrap(), vec![2.0, 4.0, 6.0]);
    /// ```
    pub fn requires_grad(mut self, on: bool) -> Tensor {
        self.tape = on.then(|| {
            Tape::Leaf(Arc::new(Leaf {
                grad: Mutex::new(None),
            }))
        });
        self
    }

    /// Whether this tensor is on the tape: a leaf that requires a gradient, or
    /// computed from one outside a no-grad scope.
    pub fn tracks_grad(&self) -> bool {
        self.tape.is_some()
    }

    /// Whether this tensor is a leaf that requires a gradient (a parameter).
    pub fn is_leaf(&self) -> bool {
        matches!(self.tape, Some(Tape::Leaf(_)))
    }

    /// The same data without a tape: ops on it are not differentiated.
    pub fn detach(&self) -> Tensor {
        Tensor {
            shape: self.shape.clone(),
            var: self.var.clone(),
            device: self.device,
            tape: None,
        }
    }

    /// The gradient accumulated by [`Tensor::backward`] calls since the last
    /// [`Tensor::zero_grad`], on this tensor's device; `None` before any, and
    /// for tensors that are not leaves.
    pub fn grad(&self) -> Option<Tensor> {
        match &self.tape {
            Some(Tape::Leaf(leaf)) => leaf.grad.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            _ => None,
        }
    }

    /// Forgets the accumulated gradient (the next backward starts from zero).
    pub fn zero_grad(&self) {
        if let Some(Tape::Leaf(leaf)) = &self.tape {
            *leaf.grad.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }

    /// Records the gradient of this one-element tensor (a loss) with respect to
    /// every leaf it was computed from, and adds it to their [`Tensor::grad`].
    /// It returns at once: the gradients are computed when something demands
    /// them. The tape's saved values are freed; a second backward through the
    /// same ops is an error (see [`Tensor::backward_with`]).
    ///
    /// Fails, before recording anything, if the tensor is not on the tape, has
    /// more than one element, or the tape was freed.
    #[track_caller]
    pub fn backward(&self) -> Result<()> {
        self.backward_at(None, false, Location::caller())
    }

    /// [`Tensor::backward`] with a seed gradient of this tensor's shape (needed
    /// when it has more than one element), and optionally keeping the tape for
    /// another backward (`retain_graph`).
    ///
    /// ```
    /// use lazyflow::{Engine, Tensor};
    /// let engine = Engine::builder().workers(1).build().unwrap();
    /// let x = Tensor::from_vec_in(&engine, vec![1.0, 2.0], [2]).unwrap().requires_grad(true);
    /// let y = x.exp();
    /// let seed = Tensor::from_vec_in(&engine, vec![1.0, 0.5], [2]).unwrap();
    /// y.backward_with(Some(&seed), true).unwrap();
    /// y.backward_with(Some(&seed), false).unwrap(); // accumulates
    /// let g = x.grad().unwrap().to_vec().unwrap();
    /// assert!((g[1] - 2.0 * 0.5 * 2f32.exp()).abs() < 1e-4);
    /// assert!(y.backward_with(Some(&seed), false).is_err()); // the tape is freed
    /// ```
    #[track_caller]
    pub fn backward_with(&self, seed: Option<&Tensor>, retain_graph: bool) -> Result<()> {
        self.backward_at(seed, retain_graph, Location::caller())
    }

    fn backward_at(&self, seed: Option<&Tensor>, retain: bool, location: Location) -> Result<()> {
        let err = |reason: String| Error::InvalidArgument {
            op: "backward",
            shape: self.shape.to_string(),
            reason,
            location,
        };
        let Some(root) = &self.tape else {
            return Err(err(
                "the tensor does not require a gradient (make a leaf with \
                 requires_grad(true) and compute from it outside no_grad)"
                    .to_string(),
            ));
        };
        let seed = match seed {
            Some(s) => {
                if s.shape != self.shape || s.device != self.device {
                    return Err(err(format!(
                        "the seed gradient must have the tensor's shape and device \
                         (got {} on {})",
                        s.shape, s.device
                    )));
                }
                s.detach()
            }
            None => {
                if self.numel() != 1 {
                    return Err(err(format!(
                        "needs a seed gradient for a tensor of {} elements \
                         (use backward_with)",
                        self.numel()
                    )));
                }
                let _g = NoGrad::new();
                self.full_shaped(self.shape.clone(), 1.0, location)
            }
        };
        let order = match root {
            Tape::Leaf(leaf) => return accumulate(leaf, seed, location),
            Tape::Op(node) => topological(node),
        };
        // Check the whole tape first, so a freed tape records nothing.
        for node in &order {
            if node
                .backward
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_none()
            {
                return Err(err(format!(
                    "the tape through {} (recorded at {}) was freed by an earlier \
                     backward; pass retain_graph = true to backward_with to keep it",
                    node.op, node.location
                )));
            }
        }
        let _no_grad = NoGrad::new();
        let mut grads: HashMap<usize, Tensor> = HashMap::new();
        let mut leaves: HashMap<usize, (Arc<Leaf>, Tensor)> = HashMap::new();
        grads.insert(key(&order[0]), seed);
        for node in &order {
            let Some(g) = grads.remove(&key(node)) else {
                continue;
            };
            let needs: Vec<bool> = node.inputs.iter().map(Option::is_some).collect();
            let input_grads = {
                let mut slot = node.backward.lock().unwrap_or_else(|p| p.into_inner());
                let f = slot.as_ref().expect("checked above");
                let out = f(&g, &needs)?;
                if !retain {
                    *slot = None;
                }
                out
            };
            for (input, gi) in node.inputs.iter().zip(input_grads) {
                let (Some(input), Some(gi)) = (input, gi) else {
                    continue;
                };
                match input {
                    Tape::Op(n) => add_into(&mut grads, key(n), gi, location)?,
                    Tape::Leaf(leaf) => match leaves.remove(&key(leaf)) {
                        Some((l, acc)) => {
                            let sum = acc.add_at_untaped(&gi, location)?;
                            leaves.insert(key(leaf), (l, sum));
                        }
                        None => {
                            leaves.insert(key(leaf), (leaf.clone(), gi));
                        }
                    },
                }
            }
        }
        for (leaf, g) in leaves.into_values() {
            accumulate(&leaf, g, location)?;
        }
        Ok(())
    }

    /// Puts `out` (this op's output) on the tape when grad mode is on and an
    /// input is on it. `backward` gets the output's gradient and which inputs
    /// need one, and returns one gradient per input, in order.
    pub(crate) fn taped(
        mut self,
        op: &'static str,
        location: Location,
        inputs: &[&Tensor],
        backward: impl Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Tensor {
        if !grad_enabled() || inputs.iter().all(|t| t.tape.is_none()) {
            return self;
        }
        self.tape = Some(Tape::Op(Arc::new(OpNode {
            op,
            location,
            inputs: inputs.iter().map(|t| t.tape.clone()).collect(),
            backward: Mutex::new(Some(Box::new(backward))),
        })));
        self
    }

    /// Whether an op on these inputs would be taped (so it saves values).
    pub(crate) fn any_taped(inputs: &[&Tensor]) -> bool {
        grad_enabled() && inputs.iter().any(|t| t.tape.is_some())
    }

    fn add_at_untaped(&self, other: &Tensor, location: Location) -> Result<Tensor> {
        let _g = NoGrad::new();
        self.binary_at(other, super::kernels::BinaryOp::Add, location)
    }

    /// The gradient of a broadcast: sums `self` (of a broadcast shape) down to
    /// `shape`, over the leading axes `shape` lacks and the axes where it is 1.
    pub(crate) fn sum_to(&self, shape: &Shape, location: Location) -> Result<Tensor> {
        if &self.shape == shape {
            return Ok(self.clone());
        }
        let mut g = self.clone();
        let extra = g.shape.rank() - shape.rank();
        for _ in 0..extra {
            g = g.reduce_axis_at(super::kernels::ReduceOp::Sum, 0, location)?;
        }
        for (axis, &d) in shape.dims().iter().enumerate() {
            if d == 1 && g.dims()[axis] != 1 {
                let mut keep = g.dims().to_vec();
                keep[axis] = 1;
                g = g
                    .reduce_axis_at(super::kernels::ReduceOp::Sum, axis, location)?
                    .reshape_at(keep, location)?;
            }
        }
        g.reshape_at(shape.clone(), location)
    }
}

/// Adds `g` to the gradient gathered so far for node `k` (recorded at the
/// `backward` call's location).
fn add_into(
    map: &mut HashMap<usize, Tensor>,
    k: usize,
    g: Tensor,
    location: Location,
) -> Result<()> {
    let sum = match map.remove(&k) {
        Some(acc) => acc.add_at_untaped(&g, location)?,
        None => g,
    };
    map.insert(k, sum);
    Ok(())
}

/// Adds `g` to a leaf's gradient (recorded at the `backward` call's location).
fn accumulate(leaf: &Leaf, g: Tensor, location: Location) -> Result<()> {
    let mut slot = leaf.grad.lock().unwrap_or_else(|p| p.into_inner());
    let next = match &*slot {
        Some(old) => old.add_at_untaped(&g, location)?,
        None => g,
    };
    *slot = Some(next);
    Ok(())
}

/// The op nodes reachable from `root`, each before the nodes of its inputs.
fn topological(root: &Arc<OpNode>) -> Vec<Arc<OpNode>> {
    let mut post = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![(root.clone(), false)];
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            post.push(node);
            continue;
        }
        if !seen.insert(key(&node)) {
            continue;
        }
        stack.push((node.clone(), true));
        for input in &node.inputs {
            if let Some(Tape::Op(n)) = input {
                if !seen.contains(&key(n)) {
                    stack.push((n.clone(), false));
                }
            }
        }
    }
    post.reverse();
    post
}
