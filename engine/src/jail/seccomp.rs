//! The sandbox's seccomp filter: an allow-by-default list that refuses the system calls that
//! reach past the sandbox's namespaces — kernel modules, kexec, reboot, mounts (old and new API),
//! keyrings, bpf, perf, swap, clock setting, io_uring, user namespaces — with `EPERM`.
//! Built by hand as classic BPF (a few dozen instructions) rather than with a crate.

use libc::{sock_filter, sock_fprog};

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const CLONE_NEWUSER: u32 = 0x1000_0000;
/// `offsetof(struct seccomp_data, ...)`.
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARG0_LO: u32 = 16;

const SYS_CLONE: u32 = 56;
const SYS_CLONE3: u32 = 435;

/// Refused with EPERM (x86_64 numbers).
const BLOCKED: &[u32] = &[
    103, // syslog
    134, // uselib
    136, // ustat
    139, // sysfs
    153, // vhangup
    155, // pivot_root
    156, // _sysctl
    159, // adjtimex
    163, // acct
    164, // settimeofday
    165, // mount
    166, // umount2
    167, // swapon
    168, // swapoff
    169, // reboot
    172, // iopl
    173, // ioperm
    174, // create_module
    175, // init_module
    176, // delete_module
    177, // get_kernel_syms
    178, // query_module
    179, // quotactl
    180, // nfsservctl
    212, // lookup_dcookie
    227, // clock_settime
    246, // kexec_load
    248, // add_key
    249, // request_key
    250, // keyctl
    272, // unshare
    298, // perf_event_open
    303, // name_to_handle_at
    304, // open_by_handle_at
    305, // clock_adjtime
    308, // setns
    313, // finit_module
    320, // kexec_file_load
    321, // bpf
    323, // userfaultfd
    425, // io_uring_setup
    426, // io_uring_enter
    427, // io_uring_register
    428, // open_tree
    429, // move_mount
    430, // fsopen
    431, // fsconfig
    432, // fsmount
    433, // fspick
    442, // mount_setattr
];

fn stmt(code: u32, k: u32) -> sock_filter {
    sock_filter { code: code as u16, jt: 0, jf: 0, k }
}

fn jump(code: u32, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code: code as u16, jt, jf, k }
}

const LD_W_ABS: u32 = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
const JEQ_K: u32 = libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K;
const JGE_K: u32 = libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K;
const JSET_K: u32 = libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K;
const RET_K: u32 = libc::BPF_RET | libc::BPF_K;

/// The filter program.
pub fn program() -> Vec<sock_filter> {
    let mut p = vec![
        stmt(LD_W_ABS, OFF_ARCH),
        jump(JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(RET_K, SECCOMP_RET_KILL_PROCESS),
        stmt(LD_W_ABS, OFF_NR),
    ];
    // Jump targets are patched once the tail's layout is known.
    let x32 = p.len();
    p.push(jump(JGE_K, X32_SYSCALL_BIT, 0, 0));
    let clone = p.len();
    p.push(jump(JEQ_K, SYS_CLONE, 0, 0));
    let clone3 = p.len();
    p.push(jump(JEQ_K, SYS_CLONE3, 0, 0));
    let first_blocked = p.len();
    for nr in BLOCKED {
        p.push(jump(JEQ_K, *nr, 0, 0));
    }
    let allow = p.len();
    p.push(stmt(RET_K, SECCOMP_RET_ALLOW));
    let eperm = p.len();
    p.push(stmt(RET_K, SECCOMP_RET_ERRNO | libc::EPERM as u32));
    // clone3 passes flags in memory the filter cannot read: answer ENOSYS so libc uses clone.
    let enosys = p.len();
    p.push(stmt(RET_K, SECCOMP_RET_ERRNO | libc::ENOSYS as u32));
    let clone_check = p.len();
    p.push(stmt(LD_W_ABS, OFF_ARG0_LO));
    p.push(jump(JSET_K, CLONE_NEWUSER, 0, 1));
    p.push(stmt(RET_K, SECCOMP_RET_ERRNO | libc::EPERM as u32));
    p.push(stmt(RET_K, SECCOMP_RET_ALLOW));

    let offset = |from: usize, to: usize| -> u8 {
        u8::try_from(to - from - 1).expect("filter jumps fit in u8")
    };
    p[x32].jt = offset(x32, eperm);
    p[clone].jt = offset(clone, clone_check);
    p[clone3].jt = offset(clone3, enosys);
    for (i, ins) in p.iter_mut().enumerate().take(allow).skip(first_blocked) {
        ins.jt = offset(i, eperm);
    }
    p
}

/// Installs the filter on the calling thread (and what it execs). `no_new_privs` must be set.
/// Async-signal-safe apart from the allocation in `program`, so call it before `fork` or in a
/// single-threaded process.
pub fn install(filter: &[sock_filter]) -> std::io::Result<()> {
    let prog = sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut sock_filter };
    // SAFETY: `prog` points at a valid filter that outlives the call.
    let rc = unsafe {
        libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const sock_fprog)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_jump_lands_inside_the_program() {
        let p = program();
        for (i, ins) in p.iter().enumerate() {
            if u32::from(ins.code) & 0x07 == libc::BPF_JMP {
                assert!(i + 1 + (ins.jt as usize) < p.len());
                assert!(i + 1 + (ins.jf as usize) < p.len());
            }
        }
        assert!(p.len() < 100);
    }
}
