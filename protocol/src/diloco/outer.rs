//! The outer optimizer: SGD with Nesterov momentum on the averaged
//! pseudo-gradient, as in DiLoCo (lr 0.7, momentum 0.9).

use super::Tensors;

/// Nesterov momentum state.
#[derive(Clone, Debug, PartialEq)]
pub struct Nesterov {
    /// Outer learning rate.
    pub lr: f32,
    /// Momentum coefficient.
    pub momentum: f32,
    /// The velocity, one tensor per parameter (zeros at the start).
    pub velocity: Tensors,
}

impl Nesterov {
    /// Fresh state for parameters shaped like `params`.
    pub fn new(lr: f32, momentum: f32, params: &Tensors) -> Self {
        Self { lr, momentum, velocity: params.iter().map(|p| vec![0.0; p.len()]).collect() }
    }

    /// Applies `delta` (the averaged θ_start − θ_end, a descent direction
    /// like a gradient) to `params`: v ← μv + Δ; θ ← θ − lr(Δ + μv).
    pub fn step(&mut self, params: &mut Tensors, delta: &Tensors) {
        for ((p, v), d) in params.iter_mut().zip(&mut self.velocity).zip(delta) {
            for ((p, v), d) in p.iter_mut().zip(v.iter_mut()).zip(d) {
                *v = self.momentum * *v + d;
                *p -= self.lr * (d + self.momentum * *v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lr_one_without_momentum_adopts_the_average() {
        let mut params = vec![vec![1.0, 2.0]];
        let mut outer = Nesterov::new(1.0, 0.0, &params);
        // Workers ended at [0.5, 2.5]: delta = start - end.
        outer.step(&mut params, &vec![vec![0.5, -0.5]]);
        assert_eq!(params, vec![vec![0.5, 2.5]]);
    }

    #[test]
    fn nesterov_matches_pytorch_sgd() {
        // torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True), two steps.
        let mut params = vec![vec![1.0f32]];
        let mut outer = Nesterov::new(0.7, 0.9, &params);
        outer.step(&mut params, &vec![vec![0.1]]);
        // v = 0.1; p = 1 - 0.7 * (0.1 + 0.09) = 0.867
        assert!((params[0][0] - 0.867).abs() < 1e-6);
        outer.step(&mut params, &vec![vec![0.2]]);
        // v = 0.09 + 0.2 = 0.29; p = 0.867 - 0.7 * (0.2 + 0.261) = 0.5443
        assert!((params[0][0] - 0.5443).abs() < 1e-6, "{}", params[0][0]);
    }
}
