//! Tensor shapes: dimension lists, row-major strides and numpy-style
//! broadcasting.

use std::fmt;

use smallvec::SmallVec;

/// The dimensions of a tensor, outermost first (row-major).
///
/// A shape of rank 0 describes a scalar, which holds one element.
/// Up to four dimensions are stored inline without allocating.
#[derive(PartialEq, Eq, Hash, Default)]
pub struct Shape {
    dims: SmallVec<[usize; 4]>,
}

impl Clone for Shape {
    fn clone(&self) -> Shape {
        // The words copied at once: SmallVec's own `clone` pushes them one
        // by one, and every op's output shape is a clone.
        Shape {
            dims: SmallVec::from_slice(&self.dims),
        }
    }
}

impl Shape {
    /// Builds a shape from anything convertible into one, e.g.
    /// `Shape::new([2, 3])`, `Shape::new(vec![4])` or `Shape::new(())`.
    pub fn new(dims: impl Into<Shape>) -> Shape {
        dims.into()
    }

    /// The shape of a scalar (rank 0, one element).
    pub fn scalar() -> Shape {
        Shape::default()
    }

    /// The size of each dimension, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The number of dimensions (0 for a scalar).
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The number of elements: the product of the dimensions, 1 for a
    /// scalar and 0 if any dimension is 0.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Row-major strides, in elements, of a contiguous tensor of this shape.
    ///
    /// The last dimension has stride 1; each other stride is the product of
    /// the dimensions after it.
    pub fn strides(&self) -> SmallVec<[usize; 4]> {
        let mut strides: SmallVec<[usize; 4]> = SmallVec::from_elem(0, self.dims.len());
        let mut acc = 1usize;
        for (s, &d) in strides.iter_mut().zip(self.dims.iter()).rev() {
            *s = acc;
            acc *= d;
        }
        strides
    }

    /// The shape two operands broadcast to under numpy rules, or `None` if
    /// they are incompatible.
    ///
    /// Shapes are aligned at their last dimension; missing leading
    /// dimensions count as 1, and each aligned pair must be equal or contain
    /// a 1 (which stretches to the other size, including to 0).
    pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
        let (da, db) = (a.dims(), b.dims());
        if da.len() == db.len() && da.iter().zip(db).all(|(x, y)| x == y) {
            // The usual case, without the walk.
            return Some(a.clone());
        }
        let rank = a.rank().max(b.rank());
        let mut dims: SmallVec<[usize; 4]> = SmallVec::from_elem(1, rank);
        for (i, d) in dims.iter_mut().enumerate() {
            let da = dim_from_right(a.dims(), rank - 1 - i);
            let db = dim_from_right(b.dims(), rank - 1 - i);
            *d = if da == db || db == 1 {
                da
            } else if da == 1 {
                db
            } else {
                return None;
            };
        }
        Some(Shape { dims })
    }

    /// Whether a tensor of this shape can be broadcast to `target` without
    /// changing `target`, i.e. `broadcast(self, target) == Some(target)`.
    pub fn broadcasts_to(&self, target: &Shape) -> bool {
        if self.rank() > target.rank() {
            return false;
        }
        self.dims
            .iter()
            .rev()
            .zip(target.dims.iter().rev())
            .all(|(&s, &t)| s == t || s == 1)
    }
}

/// Dimension `from_right` places left of the last one, 1 when the shape is
/// too short (the implicit leading ones of broadcasting).
fn dim_from_right(dims: &[usize], from_right: usize) -> usize {
    if from_right < dims.len() {
        dims[dims.len() - 1 - from_right]
    } else {
        1
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Shape {
        Shape {
            dims: SmallVec::from_slice(dims),
        }
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Shape {
        Shape {
            dims: SmallVec::from_vec(dims),
        }
    }
}

impl From<&Vec<usize>> for Shape {
    fn from(dims: &Vec<usize>) -> Shape {
        Shape::from(dims.as_slice())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(dims: [usize; N]) -> Shape {
        Shape::from(&dims[..])
    }
}

impl From<usize> for Shape {
    /// A one-dimensional shape.
    fn from(len: usize) -> Shape {
        Shape::from([len])
    }
}

impl From<()> for Shape {
    /// The scalar shape (rank 0).
    fn from(_: ()) -> Shape {
        Shape::default()
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(dims: &[usize]) -> Shape {
        Shape::from(dims)
    }

    #[test]
    fn constructors_agree() {
        let expected = s(&[2, 3]);
        assert_eq!(Shape::new([2, 3]), expected);
        assert_eq!(Shape::new(vec![2, 3]), expected);
        let v = vec![2, 3];
        assert_eq!(Shape::new(&v), expected);
        assert_eq!(Shape::new(&[2usize, 3][..]), expected);
        assert_eq!(Shape::new(5).dims(), &[5]);
        assert_eq!(Shape::new(()).rank(), 0);
        assert_eq!(Shape::new(()), Shape::scalar());
        assert_eq!(Shape::new([0usize; 0]), Shape::scalar());
    }

    #[test]
    fn rank_and_numel() {
        assert_eq!(Shape::scalar().numel(), 1);
        assert_eq!(Shape::scalar().rank(), 0);
        assert_eq!(s(&[2, 3, 4]).numel(), 24);
        assert_eq!(s(&[2, 3, 4]).rank(), 3);
        assert_eq!(s(&[2, 0, 4]).numel(), 0);
        assert_eq!(s(&[7]).numel(), 7);
        // More than the inline capacity still works.
        let big = s(&[1, 2, 3, 4, 5, 6]);
        assert_eq!(big.rank(), 6);
        assert_eq!(big.numel(), 720);
    }

    #[test]
    fn strides_row_major() {
        assert_eq!(s(&[2, 3, 4]).strides().as_slice(), &[12, 4, 1]);
        assert_eq!(s(&[5]).strides().as_slice(), &[1]);
        assert!(Shape::scalar().strides().is_empty());
        assert_eq!(s(&[3, 1, 2]).strides().as_slice(), &[2, 2, 1]);
        assert_eq!(s(&[2, 0, 3]).strides().as_slice(), &[0, 3, 1]);
    }

    #[test]
    fn broadcast_rules() {
        let b = |x: &[usize], y: &[usize]| Shape::broadcast(&s(x), &s(y));
        assert_eq!(b(&[2, 3], &[2, 3]), Some(s(&[2, 3])));
        assert_eq!(b(&[2, 3], &[3]), Some(s(&[2, 3])));
        assert_eq!(b(&[3], &[2, 3]), Some(s(&[2, 3])));
        assert_eq!(b(&[2, 1], &[1, 3]), Some(s(&[2, 3])));
        assert_eq!(b(&[4, 1, 5], &[3, 1]), Some(s(&[4, 3, 5])));
        assert_eq!(b(&[], &[2, 3]), Some(s(&[2, 3])));
        assert_eq!(b(&[2, 3], &[]), Some(s(&[2, 3])));
        assert_eq!(b(&[], &[]), Some(Shape::scalar()));
        assert_eq!(b(&[0], &[1]), Some(s(&[0])));
        assert_eq!(b(&[1], &[0]), Some(s(&[0])));
        assert_eq!(b(&[2, 3], &[2]), None);
        assert_eq!(b(&[0], &[2]), None);
        assert_eq!(b(&[2, 3, 4], &[3, 5]), None);
    }

    #[test]
    fn broadcasts_to_rules() {
        assert!(s(&[3]).broadcasts_to(&s(&[2, 3])));
        assert!(s(&[1, 3]).broadcasts_to(&s(&[2, 3])));
        assert!(Shape::scalar().broadcasts_to(&s(&[2, 3])));
        assert!(s(&[2, 3]).broadcasts_to(&s(&[2, 3])));
        assert!(s(&[1]).broadcasts_to(&s(&[0])));
        assert!(!s(&[2, 3]).broadcasts_to(&s(&[3])));
        assert!(!s(&[2, 1]).broadcasts_to(&s(&[1, 3])));
        assert!(!s(&[2]).broadcasts_to(&s(&[2, 3])));
        assert!(!s(&[2, 3]).broadcasts_to(&Shape::scalar()));
    }

    #[test]
    fn formatting() {
        assert_eq!(format!("{}", s(&[2, 3])), "[2, 3]");
        assert_eq!(format!("{:?}", s(&[2, 3])), "[2, 3]");
        assert_eq!(format!("{}", Shape::scalar()), "[]");
        assert_eq!(format!("{:?}", Shape::scalar()), "[]");
        assert_eq!(format!("{}", s(&[7])), "[7]");
    }
}
