//! Blocking work (hashing, disk reads and writes) off the event loop, bounded.

use std::collections::VecDeque;

use tokio::task::JoinSet;

/// A job for a blocking thread.
type Job<T> = Box<dyn FnOnce() -> T + Send + 'static>;

/// Blocking work (hashing, disk reads and writes) run off the event loop on at most
/// `max_running` threads, with at most `max_queued` jobs waiting. The event loop owns it,
/// so no job outlives the loop unnoticed: dropping it aborts what has not started.
pub(crate) struct Blocking<T> {
    running: JoinSet<T>,
    queue: VecDeque<Job<T>>,
    max_running: usize,
    max_queued: usize,
}

impl<T> std::fmt::Debug for Blocking<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blocking").field("running", &self.running.len()).field("queued", &self.queue.len()).finish()
    }
}

impl<T: Send + 'static> Blocking<T> {
    pub(crate) fn new(max_running: usize, max_queued: usize) -> Self {
        Self { running: JoinSet::new(), queue: VecDeque::new(), max_running: max_running.max(1), max_queued }
    }

    /// Starts `job` or queues it; when the queue is full the job is handed back for the
    /// caller to run in place (backpressure without an unbounded queue).
    pub(crate) fn submit<F: FnOnce() -> T + Send + 'static>(&mut self, job: F) -> Result<(), F> {
        if self.running.len() < self.max_running {
            self.running.spawn_blocking(job);
        } else if self.queue.len() < self.max_queued {
            self.queue.push_back(Box::new(job));
        } else {
            return Err(job);
        }
        Ok(())
    }

    /// Whether nothing is running (then [`Blocking::next`] would wait forever).
    pub(crate) fn is_idle(&self) -> bool {
        self.running.is_empty()
    }

    /// The next finished job's output; starts a queued job in its place. Cancel-safe.
    pub(crate) async fn next(&mut self) -> Option<T> {
        loop {
            let joined = self.running.join_next().await?;
            if let Some(job) = self.queue.pop_front() {
                self.running.spawn_blocking(job);
            }
            match joined {
                Ok(out) => return Some(out),
                Err(e) => tracing::error!("blocking blob work failed: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn blocking_work_is_bounded_and_overflow_is_handed_back() {
        let mut work: Blocking<u32> = Blocking::new(1, 2);
        assert!(work.is_idle());
        for i in 0..3 {
            assert!(work.submit(move || i).is_ok(), "job {i} runs or waits");
        }
        // one running, two queued: the next job comes back to run in place
        let Err(job) = work.submit(|| 3) else {
            panic!("a full queue must hand the job back");
        };
        assert_eq!(job(), 3);
        let mut done = Vec::new();
        while let Some(i) = work.next().await {
            done.push(i);
        }
        assert_eq!(done, vec![0, 1, 2], "queued jobs start as running ones finish, in order");
        assert!(work.is_idle());
    }
}
