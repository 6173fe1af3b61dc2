//! Large zeroed buffers backed by transparent huge pages where the kernel
//! allows it (`madvise` mode): staging blocks and load buffers are touched
//! once end to end, and 2 MiB pages cut the page faults of that first touch
//! by 512x (measured: a fresh 1 GiB costs 0.4-3 s of faults on the VM, versus
//! ~0.1 s once mapped).

const HUGE: usize = 2 << 20;

/// A zeroed buffer of `len` bytes. Large ones are asked to use huge pages
/// before their first touch; the advice is best effort.
pub fn zeroed(len: usize) -> Vec<u8> {
    let v = vec![0u8; len];
    if len >= 2 * HUGE {
        advise_huge(&v);
    }
    v
}

#[cfg(target_os = "linux")]
fn advise_huge(v: &[u8]) {
    let start = v.as_ptr() as usize;
    let aligned = (start + HUGE - 1) & !(HUGE - 1);
    let end = (start + v.len()) & !(HUGE - 1);
    if end > aligned {
        // SAFETY: the range lies inside this allocation; MADV_HUGEPAGE only
        // changes how future faults are served, never the contents.
        unsafe {
            libc::madvise(
                aligned as *mut libc::c_void,
                end - aligned,
                libc::MADV_HUGEPAGE,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_v: &[u8]) {}

#[cfg(test)]
mod tests {
    #[test]
    fn buffers_are_zeroed_and_sized() {
        for len in [0, 1, 4095, 8 << 20] {
            let v = super::zeroed(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&b| b == 0));
        }
    }
}
