//! Small synchronisation helpers shared by the engine and its front ends.

use std::sync::{Mutex, MutexGuard};

/// Lock a mutex, ignoring poisoning: a panic on one thread must not turn
/// every later call on the others into a panic. The data behind our mutexes
/// is kept consistent by each critical section, not by unwinding.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
