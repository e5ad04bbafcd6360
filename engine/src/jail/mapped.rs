//! Files mapped read-only and handed on as [`bytes::Bytes`] (a snapshot's memory images: see
//! `memory::write_memory_entry`), so their bytes reach the store without a copy.

/// A file mapped read-only, as [`bytes::Bytes`] that unmap it when the last is dropped. Only
/// images CRIU finished writing are mapped, and nothing on the host truncates them (a box's
/// removal unlinks them, which leaves a mapping whole).
pub(super) struct Mapped {
    at: *mut libc::c_void,
    len: usize,
}

// SAFETY: a read-only mapping, never written through; unmapped once, on drop.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    /// `file`, which is `len` bytes long (a file of another length is refused: reading past
    /// its end would fault).
    pub(super) fn of(file: &std::fs::File, len: u64) -> std::io::Result<bytes::Bytes> {
        use std::os::fd::AsRawFd;
        if file.metadata()?.len() != len {
            return Err(std::io::Error::other("a memory image changed size"));
        }
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        if len == 0 {
            return Ok(bytes::Bytes::new());
        }
        // SAFETY: a new shared read-only mapping of an open file; checked for failure.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                // Not populated up front: an image of a sandbox hibernated long ago may be out
                // of the page cache, and its reader (the store's cut) faults it in as it goes.
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(bytes::Bytes::from_owner(Mapped { at, len }))
    }
}

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable at `at` for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.at.cast::<u8>(), self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, unmapped once.
        unsafe { libc::munmap(self.at, self.len) };
    }
}
