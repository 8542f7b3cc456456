# Flat 64 KiB BIOS image, mapped by QEMU at 0xF0000-0xFFFFF. Entered at the reset vector (offset 0xFFF0).
# STAGE selects where we exit: 1 = real mode, 2 = protected mode, 3 = long mode.
	.set BASE, 0xF0000
	.code16
	.org 0
start16:
	cli
.if STAGE == 1  # diagnostics only
	mov $0x11, %al
	out %al, $0xf4
	hlt
.endif
	xor %ax, %ax
	mov %ax, %ds
	lgdtl %cs:(gdt_desc - start16)
	mov %cr0, %eax
	or $1, %eax
	mov %eax, %cr0
	ljmpl $0x08, $(BASE + start32 - start16)
	.code32
start32:
	mov $0x10, %ax
	mov %ax, %ds
	mov %ax, %es
	mov %ax, %ss
.if STAGE == 2
	mov $0x12, %al
	out %al, $0xf4
	hlt
.endif
	# page tables at 0x1000 (PML4), 0x2000 (PDPT), 0x3000 (PD): identity map the first 2 MiB
	mov $0x1000, %edi
	xor %eax, %eax
	mov $0xC00, %ecx
	rep stosl
	movl $0x2003, 0x1000
	movl $0x3003, 0x2000
	movl $0x0083, 0x3000
	mov %cr4, %eax
	or $0x20, %eax          # PAE
	mov %eax, %cr4
	mov $0x1000, %eax
	mov %eax, %cr3
	mov $0xC0000080, %ecx   # EFER
	rdmsr
	or $0x100, %eax         # LME
	wrmsr
	mov %cr0, %eax
	or $0x80000000, %eax    # PG
	mov %eax, %cr0
	ljmp $0x18, $(BASE + start64 - start16)
	.code64
start64:
	mov $0x10, %ax
	mov %ax, %ds
	movq $0x1234, 0x4000     # a write through the page tables
	mov $0x13, %al
	out %al, $0xf4
	hlt
	.p2align 3
gdt:
	.quad 0
	.quad 0x00CF9A000000FFFF   # 0x08: 32-bit code
	.quad 0x00CF92000000FFFF   # 0x10: data
	.quad 0x00AF9A000000FFFF   # 0x18: 64-bit code
gdt_desc:
	.word gdt_desc - gdt - 1
	.long BASE + gdt - start16
	.org 0xFFF0, 0xf4
	.code16
	ljmp $0xF000, $0
	.org 0x10000, 0xf4
